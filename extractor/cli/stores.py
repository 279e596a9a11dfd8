"""``extractor inspect``, ``show``, ``probe`` and ``compare``: what a store holds, drawn, probed, compared."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .._text import size, table
from ..errors import ExtractorError, StoreError
from .common import _int, _save, _store_options


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
    from ..read import open_store

    if getattr(args, "objects", False) and not args.verify:
        raise ExtractorError("--objects checks the store's objects with --verify: extractor inspect STORE --verify "
                             "--objects")
    store = open_store(args.store, _store_options(args))
    if args.verify:
        return _verify_objects(store, args.json) if getattr(args, "objects", False) else _verify(store, args.json)
    s = store.summary(du=args.du)
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return 0
    _print_summary(s)
    return 0


def _model_line(m: dict[str, Any]) -> str:
    if m.get("name") is None:
        return "not recorded (a store written without a job)"
    return (f"{m['name']}: {m.get('weights')}; {m.get('parameters') or 0:,} parameters; "
            f"state sha256 {(m.get('state_dict_sha256') or '?')[:12]}")


def _print_stats(stats: dict[str, Any]) -> None:
    """``extractor inspect``'s table of each capture's statistics."""
    def g(v: object) -> str:
        return "-" if v is None else f"{v:.4g}"

    rows = []
    for k, st in stats.items():
        # no finite value (no ok rows, or all NaN/Inf): the stored moments are 0 and mean nothing
        seen = st["min"] is not None
        mean = sum(st["mean"]) / max(len(st["mean"]), 1) if seen else None
        std = sum(st["std"]) / max(len(st["std"]), 1) if seen else None
        rows.append([k, g(mean), g(std), g(st["min"]), g(st["max"]), g(st["mean_l2"]), str(st["nan"]),
                     str(st["inf"]), str(st["nonfinite_rows"])])
    print()
    print(table(rows, ["key", "mean", "std", "min", "max", "row L2", "NaN", "Inf", "rows NaN/Inf"]))
    print("(mean and std: averaged over the per-feature values; --json has them per feature)")


def _print_summary(s: dict[str, Any]) -> None:
    """``extractor inspect``'s lines for people."""
    m = s["model"]
    rs = s["row_status"]
    print(f"store   {s['store']}  (format {s['format_version']}, status {s['status']}, updated {s['updated']})")
    if s["silent_s"] is not None:
        print(f"        its job has been silent for {s['silent_s']:.0f} s (killed?): run it again with --resume "
              "to finish the store")
    print(f"model   {_model_line(m)}")
    if s["preprocess"]:
        print(f"pixels  {_pixels_line(s['preprocess'])}")
    print(f"rows    {s['rows']}: {rs['ok']} ok, {rs['failed']} failed, {rs['pending']} pending; "
          f"shards {s['shards']['done']}/{s['shards']['total']} done")
    for w in s["writing"]:
        print(f"writing pid {w['pid']} on {w['host']} (user {w['user']}, started {w['started']}): {w['shards']} "
              f"shards committed so far{' (joined)' if w.get('join') else ''}")
    if s["classes"]:
        shown = ", ".join(s["classes"][:10]) + (", ..." if len(s["classes"]) > 10 else "")
        print(f"classes {len(s['classes'])}: {shown}")
    rows = [
        [k, c["layer"], c["what"] + (f"[{c['index']!r}]" if c.get("index") is not None else ""), c["reduce"],
         c["dtype"], "x".join(map(str, c["shape"])), "-" if c["bytes_stored"] is None else size(c["bytes_stored"])]
        for k, c in s["captures"].items()
    ]
    print()
    print(table(rows, ["key", "layer", "what", "reduce", "dtype", "shape", "stored"]))
    if s["stats"]:
        _print_stats(s["stats"])
    lines = [] if s["bytes_committed"] is None else \
        [f"values its committed shards wrote {size(s['bytes_committed'])} (before compression)"]
    if s["bytes_on_disk"] is not None:
        lines.append(f"bytes on disk {size(s['bytes_on_disk'])}")
    else:
        lines.append("each capture's stored bytes and the bytes on disk: extractor inspect --du (every object stat-ed)")
    print("\n" + "\n".join(lines))


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


def _verify_objects(store: Any, as_json: bool) -> int:
    """``inspect --verify --objects``: every object the store's commits name, present and decoding."""
    result = store.verify_objects()
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(f"verified {store.url}: {result['checked']} objects its commits name, {len(result['missing'])} missing, "
              f"{len(result['damaged'])} damaged")
        for key in result["missing"][:20]:
            print(f"  missing: {key}")
        for key, error in result["damaged"][:20]:
            print(f"  damaged: {key}: {error}")
        more = len(result["missing"]) + len(result["damaged"]) - min(len(result["missing"]), 20) - \
            min(len(result["damaged"]), 20)
        if more > 0:
            print(f"  ... and {more} more")
    return 1 if result["missing"] or result["damaged"] else 0


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

    from ..read import gradcam_grid, image_grid, open_store

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

    from ..read import finite, principal_components, scatter_plot

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

    from ..read import image_grid, top_rows

    if args.top.endswith(".npy") and not Path(args.top).is_file():
        raise ExtractorError(f"--top {args.top}: no such file (a .npy vector of a direction)")
    feature = np.load(args.top) if args.top.endswith(".npy") else _int(args.top, "--top")
    rows, values = top_rows(store, key, feature, k=args.k, pool=args.pool)
    captions = [f"{r}: {v:.4g}" for r, v in zip(rows, values, strict=True)]
    return image_grid(store, rows, columns=args.columns, captions=captions)


def _print_probe(results: dict) -> None:
    rows = [[k, str(r["features"]), str(r["rows"]), f"{r['accuracy']:.3f} +- {r['std']:.3f}", f"{r['chance']:.3f}"]
            for k, r in results.items()]
    print(table(rows, ["key", "features", "rows", "accuracy", "chance"]))


def cmd_probe(args: argparse.Namespace) -> int:
    from ..read import bar_chart, open_store, probe_store

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
    from ..read import compare

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
    from ..read import open_store

    url, _, key = item.rpartition(":")
    if url and key and "/" not in key:
        store = opened.get(url) or open_store(url, options)
        opened[url] = store
        if key not in store.keys:
            raise StoreError(f"{key!r} is not a capture of {url}; its captures: {', '.join(store.keys)}")
        return store, key
    opened[item] = opened.get(item) or open_store(item, options)
    return opened[item], None

