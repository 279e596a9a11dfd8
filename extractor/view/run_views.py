"""The local app's routes of "run this image" and search by text (:mod:`.run`): the one request that is not a GET
(an image's bytes, bounded, with the :data:`~.run.HEADER` header), and the GETs that show what it gave."""

from __future__ import annotations

from typing import Any

from flask import Flask, jsonify, request

from .common import page_path
from .render import render
from .run import HEADER, Runs
from .site import Site

__all__ = ["add_run_views"]


def add_run_views(app: Flask, site: Site, device: str) -> Runs:
    """Add the routes to ``app`` (the image at most ``MAX_IMAGE_BYTES``: a larger request is a 413)."""
    from ..live import MAX_IMAGE_BYTES, LiveError

    runs = Runs(site, device)
    site.live = True
    app.config["MAX_CONTENT_LENGTH"] = MAX_IMAGE_BYTES + 4096

    def run_page() -> str:
        return render("run.html", page_path("run"), {"title": "run an image", "indexes": list(site.indexes)}, "app")

    def run_image() -> Any:
        if request.headers.get(HEADER) != "1":
            return jsonify({"error": f"an image to run is sent by the viewer's page (with the {HEADER} header)"}), 403
        return jsonify({"id": runs.add(request.get_data(cache=False))})

    rules: list[tuple[str, Any, list[str]]] = [
        ("/run.html", run_page, ["GET"]),
        ("/api/run", run_image, ["POST"]),
        ("/api/run/<key>.json", lambda key: jsonify(runs.page(key)), ["GET"]),
        ("/api/run/<key>/off/<slug>/<int:f>.json", lambda key, slug, f: jsonify(runs.switched_off(key, slug, f)),
         ["GET"]),
        ("/api/index/<slug>/text.json", lambda slug: jsonify(runs.text(slug, request.args.get("q", "")[:200])),
         ["GET"]),
    ]
    for rule, view, methods in rules:
        app.add_url_rule(rule, rule, view, methods=methods)
    app.register_error_handler(LiveError, lambda err: (jsonify({"error": str(err)}), 400))
    app.register_error_handler(413, lambda err: (jsonify({"error": f"an image of at most {MAX_IMAGE_BYTES:,} bytes "
                                                                    "is taken"}), 413))
    return runs

