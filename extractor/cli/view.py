"""``extractor view``: a store and its feature indexes in the browser, served here or written as a static site."""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .common import _store_options

if TYPE_CHECKING:
    from ..read import ActivationStore

log = logging.getLogger("extractor")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def cmd_view(args: argparse.Namespace) -> int:
    from ..read import open_store

    store = open_store(args.store, _store_options(args))
    if args.export:
        return _export(store, args)
    from ..view import serve

    if args.host not in LOOPBACK:
        log.warning("the viewer listens on %s: anyone who reaches this machine there can read the store's images "
                    "and activations", args.host)
    chosen = " (--port 0: a free port, chosen now)" if args.port == 0 else ""
    with contextlib.suppress(KeyboardInterrupt):
        serve(store, args.host, args.port,
              announce=lambda url: print(f"the viewer of {args.store}: {url}{chosen} (Ctrl-C stops it)", flush=True),
              live=not args.no_run, device=args.device)
    return 0


def _export(store: ActivationStore, args: argparse.Namespace) -> int:
    from ..view import export_site

    written = export_site(store, args.export, features=args.features, images=args.images,
                          progress=lambda line: log.info("%s", line), api=args.api)
    gone = f"; the source of {written['gone']} image(s) is gone (their pages say so)" if written["gone"] else ""
    pages, api = written["page_bytes"], f" and their JSON {_mb(written['api_bytes'])}" if args.api else ""
    print(f"wrote {written['pages']} pages ({_mb(pages)}, {pages / max(written['pages'], 1) / 1024:.0f} KiB a page)"
          f"{api} and {written['thumbnails']} thumbnails ({_mb(written['thumb_bytes'])}) to {args.export}{gone}")
    print(f"open {Path(args.export).resolve() / 'index.html'}, or serve the folder with any web server")
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
