"""``extractor demo``: a small job on drawn images, run, inspected and drawn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import _command, _save
from .run import _run_spec
from .stores import _print_probe, cmd_inspect


def cmd_demo(args: argparse.Namespace) -> int:
    import yaml

    from ..demo import DEMO_JOB, write_sample_images
    from ..spec import apply_overrides, parse_spec

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
        cmd_inspect(argparse.Namespace(store=spec.output.store, json=False, verify=False, du=True))
        from ..read import bar_chart, open_store, principal_components, probe_store, scatter_plot

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
        _next_steps(spec.output.store)
    return code


def _next_steps(store: str) -> None:
    """The commands to try next on the demo's store (``demo.NEXT``), each as it pastes."""
    from ..demo import NEXT

    print("\nNext, try:")
    for what, args in NEXT:
        print(f"  {_command(*(store if a == 'STORE' else a for a in args))}    # {what}")

