"""``extractor index``: what every feature of a capture responds to (a feature index, kept in the store)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .._progress import Progress
from .common import _at_least, _save, _store_options


def cmd_index(args: argparse.Namespace) -> int:
    """``extractor index STORE``: the store's indexes; with ``--key K``, make one first; ``--feature F`` or
    ``--densities``: draw one (to ``--out``)."""
    from ..index import describe, index_names, open_index, summary
    from ..read import open_store

    options = _store_options(args)
    store = open_store(args.store, options)
    name = args.name
    if args.key is not None:
        name = _make(store, args)
        store = open_store(args.store, options)  # as it is now: with the index just made
    elif args.atlas:
        from ..index import add_atlas

        name = add_atlas(store, name).name
        store = open_store(args.store, options)
    if args.feature is not None or args.densities:
        ix = open_index(store, name)
        _save(ix.top_figure(args.feature, columns=args.columns) if args.feature is not None else ix.density_figure(),
              args.out)
        print(f"wrote {args.out}")
        return 0
    indexes = [open_index(store, n) for n in ([name] if name else index_names(store))]
    if args.json:
        print(json.dumps([summary(ix) for ix in indexes], indent=1))
    elif not indexes:
        print(f"{args.store} holds no feature index; make one with: extractor index {args.store} --key KEY")
    for ix in indexes if not args.json else []:
        print("\n".join(describe(ix)))
    return 0


def _make(store: Any, args: argparse.Namespace) -> str:
    """Index ``args.key`` of ``store`` (a progress bar on the way); the index's name."""
    from ..index import index

    bar = Progress(enabled=not (args.quiet or args.json), unit="rows")
    bar.start(len(store.ok_rows()))
    done = [0]

    def on_progress(n: int) -> None:
        done[0] += n
        bar.update(done[0])

    try:
        made = index(store, args.key, dictionary=args.dictionary, k=args.k, pool=args.pool, name=args.name,
                     threshold=args.threshold, activation=args.activation, include_prefix=args.include_prefix,
                     normalize=args.normalize, atlas=not args.no_atlas, on_progress=on_progress)
    finally:
        bar.close()
    return made.name


def _normalize(text: str) -> str | list[str]:
    """``--normalize``: mean, norm, or both (``mean,norm``)."""
    asked = [t.strip() for t in text.split(",") if t.strip()]
    if not asked or not set(asked) <= {"mean", "norm"}:
        raise argparse.ArgumentTypeError(f"takes mean, norm or mean,norm, not {text!r}")
    return asked[0] if len(asked) == 1 else asked


def add_index_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    ix = sub.add_parser("index", parents=parents,
                        help="what every feature of a capture responds to: top images, densities, histograms")
    ix.add_argument("store")
    ix.add_argument("--key", help="the capture to index (without it: list the store's indexes)")
    ix.add_argument("--dictionary", metavar="FILE", help="an SAE's encoder (.safetensors, .npz, .pt or a SAELens "
                    "folder): index its latents instead of the capture's own features")
    ix.add_argument("--activation", help="the dictionary's activation: relu | jumprelu | topk:K (default: the file's)")
    ix.add_argument("--k", type=_at_least(1), default=16, help="top rows kept per feature (default 16)")
    ix.add_argument("--pool", choices=["max", "mean"], default="max",
                    help="what ranks a row: the feature's max over its positions (default) or its mean")
    ix.add_argument("--threshold", type=float, default=0.0, help="a feature fires above this (default 0)")
    ix.add_argument("--include-prefix", action="store_true", help="index a token sequence's prefix tokens (CLS, "
                    "registers) too; by default its patches only, as its heatmaps show")
    ix.add_argument("--normalize", type=_normalize, metavar="mean|norm|mean,norm",
                    help="scale each token first as token_batches(normalize=...) does, from the store's statistics "
                    "of the same tokens (patches only unless --include-prefix): an SAE trained on normalised tokens")
    ix.add_argument("--name", help="the index's name in the store (default: KEY, or KEY@DICTIONARY_STEM)")
    ix.add_argument("--no-atlas", action="store_true", help="no atlas (each feature's neighbours, a map of all) "
                    "after the pass (it reads at most 1,024 rows more)")
    ix.add_argument("--atlas", action="store_true", help="without --key: add an atlas to the index named by --name "
                    "(one made at write time, or with --no-atlas)")
    ix.add_argument("--feature", type=int, help="draw this feature's top images with its heatmaps to --out")
    ix.add_argument("--densities", action="store_true", help="draw the histogram of all features' densities to --out")
    ix.add_argument("--columns", type=_at_least(1), default=4, help="images per row of a --feature picture")
    ix.add_argument("--out", default="index.png")
    ix.add_argument("--json", action="store_true", help="the indexes' summary as JSON")
    ix.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ix.set_defaults(func=cmd_index)
