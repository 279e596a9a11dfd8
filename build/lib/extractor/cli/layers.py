"""``extractor layers``: a model's layers, with their shapes on one image."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from .._text import table
from ..errors import ExtractorError


def _layers_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model spec ``extractor layers`` builds (a job's, called as the job calls it, or from the command's
    name, --factory, --weights and --kwargs), and the job's data settings (None without a job)."""
    import yaml

    from ..spec import load_spec, parse_model_spec

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
    from ..data import from_dict
    from ..model import settle_preprocess

    if args.input_size:
        return args.input_size, args.input_size
    if data is not None:
        return settle_preprocess(data, from_dict(defaults) if isinstance(defaults, dict) else defaults,
                                 processor)[0].size
    if isinstance(defaults, dict):
        return from_dict(defaults).size
    raise ExtractorError(f"{defaults}: pass the input size with --input-size")


def cmd_layers(args: argparse.Namespace) -> int:
    from ..model import build_with_processor, layer_table, model_call

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

