"""The viewer as a local web app (Flask): GET only, every path parameter a number or a name looked up among the
store's own (never a file path), the store read lazily behind it."""

from __future__ import annotations

import logging
from importlib.resources import files
from typing import Any

from flask import Flask, Response, jsonify, request

from ..read import ActivationStore, open_store
from .render import render
from .site import NotFound, Site, page_path
from .thumbs import SourceGone

__all__ = ["create_app", "serve"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # loopback only, unless asked
PORT = 8050
# nothing from elsewhere: the pages' scripts, styles and images are the app's own (thumbnails, heatmaps drawn)
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
          "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def create_app(store: ActivationStore | str) -> Flask:
    """The Flask app of the viewer over ``store`` (a path or URL, or a store opened already)."""
    site = Site(open_store(store) if isinstance(store, str) else store)
    app = Flask(__name__, static_folder=str(files("extractor.view") / "static"), static_url_path="/static")
    app.config["site"] = site

    def page(template: str, path: str, data: dict[str, Any]) -> str:
        return render(template, path, data, "app")

    @app.get("/")
    @app.get("/index.html")
    def store_page() -> str:
        return page("store.html", page_path("store"), site.store_page())

    @app.get("/search.html")
    def search_page() -> str:
        return page("search.html", page_path("search"), site.search(request.args.get("q", "")[:200]))

    @app.get("/index/<slug>.html")
    def features_page(slug: str) -> str:
        return page("features.html", page_path("features", slug), site.features_page(slug))

    @app.get("/index/<slug>/<int:f>.html")
    def feature_page(slug: str, f: int) -> str:
        return page("feature.html", page_path("feature", slug, f), site.feature_page(slug, f))

    @app.get("/image/<int:row>.html")
    def image_page(row: int) -> str:
        return page("image.html", page_path("image", row), site.image_page(row))

    @app.get("/thumb/<int:row>.jpg")
    def thumb(row: int) -> Response:
        site.row(row)
        try:
            data = site.thumbs.get(row)
        except SourceGone as gone:
            raise NotFound(str(gone)) from None
        return Response(data, mimetype="image/jpeg", headers={"Cache-Control": "max-age=3600"})

    @app.get("/api/store.json")
    def store_json() -> Response:
        return jsonify(site.store_page())

    @app.get("/api/search.json")
    def search_json() -> Response:
        return jsonify(site.search(request.args.get("q", "")[:200]))

    @app.get("/api/index/<slug>.json")
    def features_json(slug: str) -> Response:
        return jsonify(site.features_page(slug))

    @app.get("/api/index/<slug>/<int:f>.json")
    def feature_json(slug: str, f: int) -> Response:
        return jsonify(site.feature_page(slug, f))

    @app.get("/api/image/<int:row>.json")
    def image_json(row: int) -> Response:
        return jsonify(site.image_page(row))

    @app.get("/api/index/<slug>/patch/<int:row>/<int:token>.json")
    def patch_json(slug: str, row: int, token: int) -> Response:
        return jsonify(site.patch_features(slug, row, token))

    @app.errorhandler(NotFound)
    def not_found(err: NotFound) -> tuple[Any, int]:
        return _missing(str(err.args[0] if err.args else err))

    @app.errorhandler(404)
    def no_route(err: Exception) -> tuple[Any, int]:
        return _missing(f"there is no page at {request.path}")

    @app.after_request
    def headers(response: Response) -> Response:
        response.headers["Content-Security-Policy"] = POLICY
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response

    return app


def _missing(reason: str) -> tuple[Any, int]:
    """The 404 answer: JSON under api/, else the not-found page."""
    if request.path.startswith("/api/"):
        return jsonify({"error": "not found", "reason": reason}), 404
    return render("missing.html", request.path.lstrip("/") or "index.html",
                  {"title": "not found", "reason": reason}, "app"), 404


def serve(store: str, host: str = HOST, port: int = PORT, announce: Any = print) -> None:
    """Serve the viewer of ``store`` until interrupted; ``announce`` gets the address once it listens."""
    from werkzeug.serving import make_server

    server = make_server(host, port, create_app(store), threaded=True)
    shown = f"[{host}]" if ":" in host else host
    announce(f"http://{shown}:{server.server_port}/")
    try:
        server.serve_forever()
    finally:
        server.server_close()
