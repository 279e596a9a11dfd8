"""The ``extractor`` command line (``build_parser`` lists its commands). Only this module prints."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ._text import estimate, size, table
from .errors import ExtractorError, FencedError, StoreError

log = logging.getLogger("extractor")

DESCRIPTION = """\
Push an image collection through a PyTorch vision model and keep what chosen layers computed
(outputs, inputs, gradients, Grad-CAM maps) in a Zarr store. Start with `extractor demo`.
List a model's layers with `extractor layers`; run a YAML job spec here with `extractor run`,
or on a Ray cluster with `extractor submit` and follow it with `extractor jobs`. Then
summarise a store with `extractor inspect`, draw it with `extractor show` and measure how
well each capture separates the labels with `extractor probe`. `extractor COMMAND --help`
gives a command's options."""


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rem = divmod(seconds, 3600)
    m, sec = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {sec:02d} s" if m else f"{sec} s"


class Estimate:
    """The job's duration, estimated once from the first batches after the first one (which
    pays for warm-up: allocations, cuDNN autotuning, compilation)."""

    def __init__(self, total: int, batch_size: int, min_seconds: float = 1.0) -> None:
        self.total, self.min_rows, self.min_seconds = total, 3 * batch_size, min_seconds
        self.start: tuple[float, int] | None = None
        self.done = False

    def update(self, n: int, now: float) -> str | None:
        """Rows processed so far at time ``now``: the estimate line, the first time it can be made."""
        if self.done:
            return None
        if self.start is None:
            self.start = (now, n)
            return None
        t0, n0 = self.start
        if n - n0 < self.min_rows or now - t0 < self.min_seconds or n >= self.total:
            return None
        self.done = True
        rate = (n - n0) / (now - t0)
        return (f"estimate: {rate:.1f} images/s after the first {n} images; "
                f"about {_duration((self.total - n) / rate)} to go for {self.total} images")


def _command(*args: str) -> str:
    """A command line the user can paste: ``extractor ARGS``, or what ran this one where that is not on PATH.
    Secrets given with ``--set`` are never printed: they are redacted, with a line saying so."""
    import shutil

    from .spec import REDACTED, redact_argv

    prog = [sys.executable, "-m", "extractor.cli"]  # python -m extractor.cli, or main() called from Python
    if Path(sys.argv[0]).name == "extractor":  # the console script: bare when on PATH, else as typed
        on_path = shutil.which("extractor")
        prog = ["extractor" if on_path and Path(on_path).resolve() == Path(sys.argv[0]).resolve() else sys.argv[0]]
    shown = redact_argv(list(args))
    line = shlex.join([*prog, *shown])
    if shown != list(args):
        line += (f"\n  (each {REDACTED} is a secret you gave with --set: give it again, or through the environment, "
                 "e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
    return line


def _save(fig: Any, out: str | Path) -> None:
    """Write a figure (PNG, PDF or SVG by the extension), creating its folder; a bad path or file type is a
    one-line error."""
    from .read.figures import save

    save(fig, out)


def _at_least(low: int):  # -> argparse type
    def parse(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n

    parse.__name__ = "int"  # argparse names the type in its "invalid int value" message
    return parse


# --------------------------------------------------------------------------- run


def _run_spec(spec: Any, resume: list[str], quiet: bool = False, resume_command: str | None = None) -> int:
    """Run ``spec`` with a progress bar; ``resume``: the arguments of the command that finishes it
    (``resume_command``: that whole command, as given by ``submit`` for a job on a cluster)."""
    finish = resume_command or _command(*resume)
    from ._progress import Progress
    from .driver import run

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
        kept = "the store was being created (what it held before is gone)" if getattr(err, "creating", False) \
            else "finished shards are kept"
        print(f"\ninterrupted; {kept}. To finish the job run:\n  {finish}", file=sys.stderr)
        return 130
    except (ExtractorError, OSError) as err:
        # the runner marks what stopped a job whose store it holds: said with the command that finishes it
        if not getattr(err, "resumable", False) or isinstance(err, FencedError):
            raise  # before the store was touched, or the store's own word: one line from main()
        if isinstance(err, OSError) and not isinstance(err, ExtractorError):  # a full disk, a dead endpoint
            kept = "The store is half-created" if getattr(err, "creating", False) else "Finished shards are kept"
            print(f"error: the storage failed: {type(err).__name__}: {err}\n{kept}; once fixed, "
                  f"finish the job with:\n  {finish}", file=sys.stderr)
        else:
            print(f"error: {err}\nOnce fixed, finish the job with:\n  {finish}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    print(summary.report())
    if summary.all_failed:
        from .data.listing import PLACE

        print(f"error: every row of {summary.store} failed (reasons above); check the images of "
              f"data.{PLACE[spec.data.source]}", file=sys.stderr)
        return 1
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .driver import check_submitted

    differs = check_submitted()  # a submitted job: the cluster's packages against the submitting machine's
    if differs:
        print(f"warning: this cluster runs {', '.join(differs)}; stored values may differ in their last bits "
              "from a run on the submitting machine", file=sys.stderr)
    spec = _job_spec(args)
    if args.dry_run:
        return _print_plan(spec, json_out=False)
    resume = ["run", args.job, *[a for s in args.set or [] for a in ("--set", s)], *(["-q"] if args.quiet else [])]
    return _run_spec(spec, [*resume, "--resume"], quiet=args.quiet, resume_command=args.resume_command)


def _print_plan(spec: Any, json_out: bool) -> int:
    from .driver import preview

    planned = preview(spec)
    print(json.dumps(planned.to_dict(), indent=2) if json_out else planned.report())
    return 1 if planned.action.startswith("run would refuse") else 0


def _job_spec(args: argparse.Namespace) -> Any:
    """The job of ``run`` and ``plan``: its YAML, ``--set`` overrides, and ``--resume``/``--overwrite``."""
    from .spec import load_spec

    overrides = list(args.set or [])
    if args.resume and args.overwrite:
        raise ExtractorError("choose one of --resume and --overwrite")
    if args.resume:
        overrides.append("output.if_exists=resume")
    if args.overwrite:
        overrides.append("output.if_exists=overwrite")
    return load_spec(args.job, overrides)


def cmd_plan(args: argparse.Namespace) -> int:
    return _print_plan(_job_spec(args), json_out=args.json)


# --------------------------------------------------------------------------- inspect


def _store_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` (repeated) as fsspec options: text, except ``true``/``false``
    and plain integers (``0123`` stays text: it may be a secret)."""
    out: dict[str, Any] = {}
    for item in getattr(args, "storage_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ExtractorError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. endpoint_url=http://host:9000")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif value.isdigit() and (value == "0" or not value.startswith("0")):
            out[key] = int(value)
        else:
            out[key] = value
    return out


def _pixels_line(p: dict[str, Any]) -> str:
    """Who made the model's input, and what the probe measured against the library's own processor."""
    if p.get("runs") == "library":
        return p.get("source", "the library's processor")
    check = p.get("check")
    if not check or not check.get("against"):
        return f"extractor's resize and crop: {p.get('source', '?')}"
    measured = check.get("measured", {})
    others = "; ".join(f"{name}: {_levels(m)}" for name, m in measured.items() if name != check["against"])
    return (f"extractor's resize and crop, equal to {check['against']} on {len(check.get('probe_images', []))} probe "
            f"images ({_levels(measured.get(check['against'], {}))}, tolerance {check.get('tolerance_levels')} "
            "levels)" + (f"; {others}" if others else ""))


def _levels(m: dict[str, Any]) -> str:
    """A probe's measured difference, in words."""
    if m.get("max_abs_levels") is None:
        return "other output sizes"
    return f"max {m['max_abs_levels']:.3g} levels, {m['max_abs_normalised']:.3g} normalised"


def cmd_inspect(args: argparse.Namespace) -> int:
    from .read import open_store

    store = open_store(args.store, _store_options(args))
    if args.verify:
        return _verify(store, args.json)
    s = store.summary()
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return 0
    m = s["model"]
    rs = s["row_status"]
    print(f"store   {s['store']}  (format {s['format_version']}, status {s['status']}, updated {s['updated']})")
    if s["silent_s"] is not None:
        print(f"        its job has been silent for {s['silent_s']:.0f} s (killed?): run it again with --resume "
              "to finish the store")
    print(f"model   {m['name']}: {m['weights']}; {m['parameters']:,} parameters; "
          f"state sha256 {m['state_dict_sha256'][:12]}")
    if s["preprocess"]:
        print(f"pixels  {_pixels_line(s['preprocess'])}")
    print(f"rows    {s['rows']}: {rs['ok']} ok, {rs['failed']} failed, {rs['pending']} pending; "
          f"shards {s['shards']['done']}/{s['shards']['total']} done")
    if s["classes"]:
        shown = ", ".join(s["classes"][:10]) + (", ..." if len(s["classes"]) > 10 else "")
        print(f"classes {len(s['classes'])}: {shown}")
    rows = [
        [k, c["layer"], c["what"] + (f"[{c['index']!r}]" if c.get("index") is not None else ""), c["reduce"],
         c["dtype"], "x".join(map(str, c["shape"])), size(c["bytes_stored"])]
        for k, c in s["captures"].items()
    ]
    print()
    print(table(rows, ["key", "layer", "what", "reduce", "dtype", "shape", "stored"]))
    if s["stats"]:
        def g(v: object) -> str:
            return "-" if v is None else f"{v:.4g}"

        rows = []
        for k, st in s["stats"].items():
            # no finite value (no ok rows, or all NaN/Inf): the stored moments are 0 and mean nothing
            seen = st["min"] is not None
            mean = sum(st["mean"]) / max(len(st["mean"]), 1) if seen else None
            std = sum(st["std"]) / max(len(st["std"]), 1) if seen else None
            rows.append([k, g(mean), g(std), g(st["min"]), g(st["max"]), g(st["mean_l2"]), str(st["nan"]),
                         str(st["inf"]), str(st["nonfinite_rows"])])
        print()
        print(table(rows, ["key", "mean", "std", "min", "max", "row L2", "NaN", "Inf", "rows NaN/Inf"]))
        print("(mean and std: averaged over the per-feature values; --json has them per feature)")
    print(f"\nbytes on disk {size(s['bytes_on_disk'])}")
    return 0


def _verify(store: Any, as_json: bool) -> int:
    """``inspect --verify``: every computed row's image read again and its content digest compared."""
    result = store.verify()
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(f"verified {store.url}: {result['checked']} rows read again, {len(result['changed'])} changed since "
              f"they were computed, {len(result['unreadable'])} unreadable now")
        for what in ("changed", "unreadable"):
            for row, id_ in result[what][:20]:
                print(f"  {what}: row {row} {id_}")
            if len(result[what]) > 20:
                print(f"  ... and {len(result[what]) - 20} more {what}")
    return 1 if result["changed"] or result["unreadable"] else 0


# --------------------------------------------------------------------------- layers


def _layers_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model spec ``extractor layers`` builds (a job's, called as the job calls it, or from the command's
    name, --factory, --weights and --kwargs), and the job's data settings (None without a job)."""
    import yaml

    from .spec import load_spec, parse_model_spec

    if args.model and args.factory:
        raise ExtractorError(f"name a model ({args.model}) or pass --factory ({args.factory}), not both")
    if args.model and args.model.endswith((".yaml", ".yml")):
        if args.weights or args.kwargs:
            raise ExtractorError(f"{args.model} is a job spec: --weights and --kwargs come from its model section")
        spec = load_spec(args.model)
        return spec.model, spec.data
    try:
        kwargs = yaml.safe_load(args.kwargs) if args.kwargs else {}
    except yaml.YAMLError as err:
        raise ExtractorError(f"--kwargs {args.kwargs!r} is not YAML: {err}") from None
    if not isinstance(kwargs, dict):
        raise ExtractorError(f"--kwargs takes a mapping, e.g. --kwargs '{{img_size: 64}}', not {args.kwargs!r}")
    return parse_model_spec({"name": None if args.factory else args.model, "factory": args.factory,
                             "weights": args.weights, "kwargs": kwargs}, "extractor layers"), None


def _layers_size(args: argparse.Namespace, defaults: Any, data: Any, processor: Any) -> tuple[int, int]:
    """The input size the layers are listed at: --input-size, the job's preprocessing, the model's library's."""
    from .data import from_dict
    from .model import settle_preprocess

    if args.input_size:
        return args.input_size, args.input_size
    if data is not None:
        return settle_preprocess(data, from_dict(defaults) if isinstance(defaults, dict) else defaults,
                                 processor)[0].size
    if isinstance(defaults, dict):
        return from_dict(defaults).size
    raise ExtractorError(f"{defaults}: pass the input size with --input-size")


def cmd_layers(args: argparse.Namespace) -> int:
    from .model import build_with_processor, layer_table, model_call

    logging.getLogger("extractor.model").setLevel(logging.ERROR)  # random init is fine for shapes
    mspec, data = _layers_model(args)
    model, info, processor = build_with_processor(mspec)
    size = _layers_size(args, info["preprocess_defaults"], data, processor)
    layers = layer_table(model, size, model_call(model, mspec))
    if args.depth is not None:
        layers = [r for r in layers if r["depth"] <= args.depth]
    if args.json:
        print(json.dumps(layers, indent=2))
        return 0
    rows = [["  " * max(r["depth"] - 1, 0) + r["name"], r["type"], r["output"], f"{r['parameters']:,}"]
            for r in layers]
    print(table(rows, ["name", "type", "output (batch 1)", "parameters"]))
    print(f"\nOutput shapes for one {size[0]}x{size[1]} image. A parent's output is what its forward returns (often, "
          "not always, its last child's output).")
    print("Capture names or globs (layer4.*.conv2) from the left column; (model) is what the model returns.")
    return 0


# --------------------------------------------------------------------------- show


def _parse_rows(text: str | None) -> slice | None:
    if not text:
        return None
    try:
        parts = [int(p) if p else None for p in text.split(":")]
    except ValueError:
        raise ExtractorError(f"--rows {text!r}: expected START:STOP, e.g. 0:16") from None
    return slice(*parts) if len(parts) > 1 else slice(parts[0], (parts[0] or 0) + 1)


def cmd_show(args: argparse.Namespace) -> int:
    import numpy as np

    from .read import gradcam_grid, image_grid, open_store

    store = open_store(args.store, _store_options(args))
    cams = [k for k, m in store.captures.items() if m["what"] == "gradcam"]
    key = args.key or (cams[0] if cams else None)
    if key is not None and key not in store.captures:
        raise ExtractorError(f"{key!r} is not a capture of {args.store}; captures: {', '.join(store.keys)}")
    if args.top is not None and key is not None:
        sheet = _top_sheet(store, key, args)
    elif key is not None and key in cams:
        sheet = gradcam_grid(store, key=key, rows=_parse_rows(args.rows or "0:16"), columns=args.columns)
    elif args.rows and args.top is None:  # the images of rows: no capture needed
        sheet = image_grid(store, np.arange(len(store))[_parse_rows(args.rows)], columns=args.columns)
    elif key is None:
        raise ExtractorError(f"name a capture with --key (one of: {', '.join(store.keys)})")
    else:
        sheet = _pca_sheet(store, key, args)
    _save(sheet, args.out)
    print(f"wrote {args.out}")
    return 0


def _pca_sheet(store: Any, key: str, args: argparse.Namespace) -> Any:
    """``show --key K``: the PCA of a sample of the capture's ok rows, coloured by label."""
    import numpy as np

    from .read import finite, principal_components, scatter_plot

    rows = store.ok_rows()
    if not len(rows):
        raise ExtractorError(f"{args.store} has no ok rows: nothing to draw (see extractor inspect)")
    if len(rows) > args.max_rows:
        rows = np.sort(np.random.default_rng(0).choice(rows, args.max_rows, replace=False))
    x, rows = finite(store.numpy(key, rows=rows).reshape(len(rows), -1).astype(np.float32), rows, key)
    points, explained = principal_components(x)
    return scatter_plot(points, store.labels[rows], store.classes, f"PCA of {key} ({len(rows)} rows)", explained)


def _top_sheet(store: Any, key: str, args: argparse.Namespace) -> Any:
    """``show --top``: the images where a feature or a direction is highest, captioned with row and value."""
    import numpy as np

    from .read import image_grid, top_rows

    if args.top.endswith(".npy") and not Path(args.top).is_file():
        raise ExtractorError(f"--top {args.top}: no such file (a .npy vector of a direction)")
    feature = np.load(args.top) if args.top.endswith(".npy") else _int(args.top, "--top")
    rows, values = top_rows(store, key, feature, k=args.k, pool=args.pool)
    captions = [f"{r}: {v:.4g}" for r, v in zip(rows, values, strict=True)]
    return image_grid(store, rows, columns=args.columns, captions=captions)


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ExtractorError(f"{what} takes a feature index or a .npy file of a direction, not {text!r}") from None


def _print_probe(results: dict) -> None:
    rows = [[k, str(r["features"]), str(r["rows"]), f"{r['accuracy']:.3f} +- {r['std']:.3f}", f"{r['chance']:.3f}"]
            for k, r in results.items()]
    print(table(rows, ["key", "features", "rows", "accuracy", "chance"]))


def cmd_probe(args: argparse.Namespace) -> int:
    from .read import bar_chart, open_store, probe_store

    store = open_store(args.store, _store_options(args))
    results = probe_store(store, args.keys or None, folds=args.folds, max_rows=args.max_rows)
    if args.json:  # for scripts: per key features, rows, accuracy, std, chance and each fold's accuracy
        print(json.dumps(results, indent=2, default=float))
    else:
        _print_probe(results)
    if args.out:
        folds = len(next(iter(results.values()))["folds"])  # fewer than --folds when there are fewer rows
        _save(bar_chart(results, f"linear probe, {folds}-fold accuracy: {args.store}"), args.out)
        print(f"wrote {args.out}", file=sys.stderr if args.json else sys.stdout)  # --json: stdout is the JSON
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .read import compare

    opened: dict[str, Any] = {}
    captures = []
    for item in args.captures:
        store, key = _store_and_key(item, opened, _store_options(args))
        captures += [(store, k) for k in ([key] if key else store.keys)]
    result = compare(captures, rows=args.rows, rsa_rows=args.rsa_rows, seed=args.seed)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.report())
    if args.out:
        _save(result.figure(), args.out)
        print(f"wrote {args.out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _store_and_key(item: str, opened: dict[str, Any], options: dict[str, Any]) -> tuple[Any, str | None]:
    """``STORE:KEY`` or ``STORE`` (a URL's own colons are the store's: the part after the last one is a key only
    when the store has that capture)."""
    from .read import open_store

    url, _, key = item.rpartition(":")
    if url and key and "/" not in key:
        store = opened.get(url) or open_store(url, options)
        opened[url] = store
        if key not in store.keys:
            raise StoreError(f"{key!r} is not a capture of {url}; its captures: {', '.join(store.keys)}")
        return store, key
    opened[item] = opened.get(item) or open_store(item, options)
    return opened[item], None


# --------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    import yaml

    from .demo import DEMO_JOB, write_sample_images
    from .spec import apply_overrides, parse_spec

    base = Path(args.dir)
    images = base / "images"
    if not images.exists():
        paths = write_sample_images(images, per_class=args.per_class)
        print(f"wrote {len(paths)} sample images to {images}", file=sys.stderr)
    raw = yaml.safe_load(DEMO_JOB)
    raw["data"]["root"] = str(images)
    raw["output"]["store"] = str(base / "demo.zarr")
    raw["output"]["if_exists"] = "overwrite"
    raw = apply_overrides(raw, list(args.set or []))
    (base / "job.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    spec = parse_spec(raw, source="demo job")
    print(f"running the demo job ({base / 'job.yaml'})", file=sys.stderr)
    # job.yaml holds the demo's paths and --set overrides; --resume overrides its if_exists: overwrite
    resume = ["run", str(base / "job.yaml"), *(["-q"] if args.quiet else []), "--resume"]
    code = _run_spec(spec, resume, quiet=args.quiet)
    if code == 0:
        print()
        cmd_inspect(argparse.Namespace(store=spec.output.store, json=False, verify=False))
        from .read import bar_chart, open_store, principal_components, probe_store, scatter_plot

        store = open_store(spec.output.store)
        results = probe_store(store, folds=5)
        folds = len(next(iter(results.values()))["folds"])  # fewer than 5 with fewer rows
        print(f"\nlinear probe against the sample classes ({folds}-fold):")
        _print_probe(results)
        _save(bar_chart(results, "demo: linear-probe accuracy"), base / "probe.png")
        points, explained = principal_components(store.numpy("embedding"))
        _save(scatter_plot(points, store.labels[store.ok_rows()], store.classes, "demo: PCA of embedding",
                           explained), base / "pca.png")
        print(f"wrote {base / 'probe.png'} and {base / 'pca.png'}")
        print(f"\nOpen it: python -c \"import extractor; s = extractor.open_store('{spec.output.store}'); "
              "print(s.numpy('embedding').shape)\"")
    return code


# --------------------------------------------------------------------------- submit and jobs


def _address(args: argparse.Namespace) -> str:
    return args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or "http://127.0.0.1:8265"


def cmd_submit(args: argparse.Namespace) -> int:
    import yaml

    from .driver import client, follow_logs
    from .driver.submit import submit
    from .spec import load_spec, looks_secret

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
    from .driver import follow_logs

    if not args.follow:
        print(c.get_job_logs(args.id), end="")
        return
    for text in follow_logs(c, args.id):
        print(text, end="", flush=True)


def _jobs_stop(c: Any, args: argparse.Namespace) -> None:
    print(f"{args.id}: {'stop requested' if c.stop_job(args.id) else 'already finished'}")


_JOBS = {"list": _jobs_list, "status": _jobs_status, "logs": _jobs_logs, "stop": _jobs_stop}


def cmd_jobs(args: argparse.Namespace) -> int:
    from .driver import client
    from .errors import ClusterError

    c = client(_address(args))
    if args.action != "list" and not args.id:
        raise ExtractorError(f"extractor jobs {args.action} needs a job id (see extractor jobs list)")
    try:
        _JOBS[args.action](c, args)
    except RuntimeError as err:  # the Jobs API answers unknown ids with a RuntimeError
        raise ClusterError(f"{args.action} {args.id or ''}: {err}") from None
    return 0


# --------------------------------------------------------------------------- main


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
    pl.set_defaults(func=cmd_plan)

    i = sub.add_parser("inspect", parents=[common, remote], help="summarise a store")
    i.add_argument("store")
    i.add_argument("--json", action="store_true")
    i.add_argument("--verify", action="store_true",
                   help="read every computed row's image again and compare its content digest (exit 1 on a change)")
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
    signals = _Signals() if argv is None else None  # the real command line: SIGTERM stops like Ctrl-C
    level = logging.WARNING - 10 * min(verbosity(args), 2)
    # -vv debugs extractor, not the libraries under it: botocore's debug log prints access key ids
    logging.basicConfig(level=max(level, logging.INFO), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("extractor").setLevel(level)
    if args.command == "layers" and not (args.model or args.factory):
        print("error: name a model (extractor layers resnet50), a job (extractor layers JOB.yaml) or pass --factory",
              file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except ExtractorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if signals is not None:
            signals.settle()
        _quiet_teardown()


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
    that runs (a slow storage) ends the process at once, still with exit code 130; one that comes as the
    process ends is ignored (Python restores the default handler as it exits: that one killed it, -2)."""

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

    def settle(self) -> None:
        """The command is done: once it was stopped, later signals change nothing."""
        import signal

        if self.stopping:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
