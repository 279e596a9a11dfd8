"""The ``extractor`` command: run, layers, inspect, demo. Only this module prints."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from .errors import ExtractorError

log = logging.getLogger("extractor")


def _bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- run


def _run_spec(spec: Any, quiet: bool = False) -> int:
    from tqdm import tqdm

    from .runner import run

    bar: list[Any] = []

    def on_start(total: int, per_row: dict[str, int]) -> None:
        n_bytes = sum(per_row.values())
        if not quiet:
            print(
                f"{total} images to process; {_bytes(n_bytes)} per row uncompressed "
                f"({', '.join(f'{k} {_bytes(v)}' for k, v in per_row.items())}); "
                f"store about {_bytes(n_bytes * total)} before compression",
                file=sys.stderr,
            )
        bar.append(tqdm(total=total, unit="img", disable=quiet, dynamic_ncols=True, file=sys.stderr))

    def on_progress(n: int) -> None:
        if bar:
            bar[0].update(n - bar[0].n)

    argv = " ".join(shlex.quote(a) for a in sys.argv)
    try:
        summary = run(spec, on_start=on_start, on_progress=on_progress)
    except KeyboardInterrupt:
        if bar:
            bar[0].close()
        resume = argv if "--resume" in sys.argv else f"{argv} --resume"
        print(f"\ninterrupted; finished shards are kept. To finish the job run:\n  {resume}", file=sys.stderr)
        return 130
    finally:
        if bar:
            bar[0].close()
    print(
        f"{summary.store}: {summary.ok} ok, {summary.failed} failed, {summary.pending} pending rows; "
        f"{summary.shards_run} shards run, {summary.shards_skipped} already done; "
        f"{summary.seconds:.1f} s, {summary.images_per_s:.1f} images/s"
    )
    if len(summary.workers) > 1 or any(w["retries"] for w in summary.workers):
        rows = [[str(w["worker"]), ",".join(map(str, w["pids"])), str(w["shards"]), str(w["images"]),
                 f"{w['images_per_s']:.1f}", str(w["retries"])] for w in summary.workers]
        print(_table(rows, ["worker", "pids", "shards", "images", "images/s", "retries"]))
    if summary.failures:
        print(f"failed rows ({summary.failed}):")
        for row, id_, err in summary.failures:
            print(f"  row {row} {id_}: {err}")
        if summary.failed > len(summary.failures):
            print(f"  ... and {summary.failed - len(summary.failures)} more (see the store's errors array)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .spec import load_spec

    overrides = list(args.set or [])
    if args.resume and args.overwrite:
        raise ExtractorError("choose one of --resume and --overwrite")
    if args.resume:
        overrides.append("output.if_exists=resume")
    if args.overwrite:
        overrides.append("output.if_exists=overwrite")
    spec = load_spec(args.job, overrides)
    return _run_spec(spec, quiet=args.quiet)


# --------------------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    from .reader import open_store

    s = open_store(args.store).summary()
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return 0
    m = s["model"]
    rs = s["row_status"]
    print(f"store   {s['store']}  (format {s['format_version']}, status {s['status']}, updated {s['updated']})")
    print(f"model   {m['name']}: {m['weights']}; {m['parameters']:,} parameters; "
          f"state sha256 {m['state_dict_sha256'][:12]}")
    print(f"rows    {s['rows']}: {rs['ok']} ok, {rs['failed']} failed, {rs['pending']} pending; "
          f"shards {s['shards']['done']}/{s['shards']['total']} done")
    if s["classes"]:
        shown = ", ".join(s["classes"][:10]) + (", ..." if len(s["classes"]) > 10 else "")
        print(f"classes {len(s['classes'])}: {shown}")
    rows = [
        [k, c["layer"], c["what"], c["reduce"], c["dtype"], "x".join(map(str, c["shape"])), _bytes(c["bytes_stored"])]
        for k, c in s["captures"].items()
    ]
    print()
    print(_table(rows, ["key", "layer", "what", "reduce", "dtype", "shape", "stored"]))
    print(f"\nbytes on disk {_bytes(s['bytes_on_disk'])}")
    return 0


# --------------------------------------------------------------------------- layers


def cmd_layers(args: argparse.Namespace) -> int:
    from .model import build_model, layer_table
    from .spec import ModelSpec

    logging.getLogger("extractor.model").setLevel(logging.ERROR)  # random init is fine for shapes
    try:
        mspec = ModelSpec(name=None if args.factory else args.model, factory=args.factory, weights=args.weights)
    except ValueError as err:
        raise ExtractorError(str(err)) from None
    model, _ = build_model(mspec)
    table = layer_table(model, args.input_size)
    if args.depth is not None:
        table = [r for r in table if r["depth"] <= args.depth]
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    rows = [["  " * max(r["depth"] - 1, 0) + r["name"], r["type"], r["output"], f"{r['parameters']:,}"]
            for r in table]
    print(_table(rows, ["name", "type", "output (batch 1)", "parameters"]))
    print("\nA parent's output is its last child's output. Capture names or globs (layer4.*.conv2)")
    print("from the left column.")
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
    from .reader import open_store
    from .show import gradcam_grid

    store = open_store(args.store)
    sheet = gradcam_grid(store, key=args.key, rows=_parse_rows(args.rows), columns=args.columns)
    sheet.save(args.out)
    print(f"wrote {args.out} ({sheet.size[0]}x{sheet.size[1]})")
    return 0


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
    code = _run_spec(spec, quiet=args.quiet)
    if code == 0:
        print()
        cmd_inspect(argparse.Namespace(store=spec.output.store, json=False))
        print(f"\nOpen it: python -c \"import extractor; s = extractor.open_store('{spec.output.store}'); "
              "print(s.numpy('embedding').shape)\"")
    return code


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="extractor", description=__doc__)
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job spec on this machine")
    r.add_argument("job", help="job spec (YAML)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec key, e.g. data.batch_size=16")
    r.add_argument("--resume", action="store_true", help="finish an existing store, skipping done shards")
    r.add_argument("--overwrite", action="store_true", help="replace an existing store")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="summarise a store")
    i.add_argument("store")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    la = sub.add_parser("layers", help="list a model's modules with output shapes")
    la.add_argument("model", nargs="?", default=None, help="torchvision model name, e.g. resnet50")
    la.add_argument("--factory", help="pkg.module:function building the model instead")
    la.add_argument("--weights", default=None)
    la.add_argument("--input-size", type=int, default=224)
    la.add_argument("--depth", type=int, default=None, help="show modules down to this nesting depth")
    la.add_argument("--json", action="store_true")
    la.set_defaults(func=cmd_layers)

    sh = sub.add_parser("show", help="draw Grad-CAM maps over their images (a PNG grid)")
    sh.add_argument("store")
    sh.add_argument("--key", help="gradcam capture to draw (default: the first)")
    sh.add_argument("--rows", default="0:16", help="rows START:STOP (default 0:16)")
    sh.add_argument("--columns", type=int, default=4)
    sh.add_argument("--out", default="gradcam.png")
    sh.set_defaults(func=cmd_show)

    d = sub.add_parser("demo", help="write sample images, run the demo job, show the store")
    d.add_argument("--dir", default="demo", help="folder for the images and the store (default: demo)")
    d.add_argument("--per-class", type=int, default=64, help="sample images per class (4 classes)")
    d.add_argument("--set", action="append", metavar="KEY=VALUE")
    d.add_argument("-q", "--quiet", action="store_true")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    # torch's transparent-huge-page allocator: +26% CPU throughput measured here (NOTES.md)
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "layers" and not (args.model or args.factory):
        print("error: name a model (extractor layers resnet50) or pass --factory", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except ExtractorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
