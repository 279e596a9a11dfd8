"""The viewer as a local web app (Flask): GET only (but the image "run this image" takes: :mod:`.run_views`), every
path parameter a number or a name looked up among the store's own (never a file path), the store read lazily behind
it; answers only for the host it listens on (:mod:`.hosts`), and only while the store is the one it opened: once it
was made again (``--overwrite``) or removed, every request (but the app's own scripts and styles) is a 410 saying so
and to restart the viewer (pages of the old store beside the new one's rows would mix two stores)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.resources import files
from typing import Any

try:
    from flask import Flask, Response, jsonify, request
except ImportError as err:
    raise ImportError("the viewer needs Flask: pip install 'extractor[view]' (make installs it)") from err

from ..errors import StoreError
from ..read import ActivationStore, open_store
from .hosts import LOOPBACK, Hosts, listen
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


def create_app(store: ActivationStore | str, hosts: Hosts = LOOPBACK, live: bool = True,
               device: str = "auto") -> Flask:
    """The Flask app of the viewer over ``store`` (a path or URL, or a store opened already), answering requests
    for ``hosts`` only (default: this machine's loopback names; any other ``Host``: 403, saying why). With ``live``
    it offers "run this image" and search by text (:mod:`.run`; the store's model built on first use, on
    ``device``)."""
    site = Site(open_store(store) if isinstance(store, str) else store)
    app = Flask(__name__, static_folder=str(files("extractor.view") / "static"), static_url_path="/static")
    app.before_request(lambda: _foreign(hosts) or _made_again(site.store))
    views = _Views(site)
    for rule, view in views.rules():
        app.add_url_rule(rule, rule, view, methods=["GET"])
    if live:
        from .run_views import add_run_views

        add_run_views(app, site, device)
    app.register_error_handler(NotFound, lambda err: _missing(str(err.args[0] if err.args else err)))
    app.register_error_handler(404, lambda err: _missing(f"there is no page at {request.path}"))
    # made again while a page was read (after the check above): that, not a 500
    app.register_error_handler(500, lambda err: _made_again(site.store) or err)
    app.after_request(_headers)
    return app


class _Views:
    """The app's answers: a page (HTML) or its data (JSON) for each path; a number or an index's name is all
    a path carries, looked up by :class:`Site` (NotFound: the 404 page)."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def rules(self) -> list[tuple[str, Callable[..., Any]]]:
        return [
            ("/", self.store_page), ("/index.html", self.store_page), ("/search.html", self.search_page),
            ("/index/<slug>.html", self.features_page), ("/index/<slug>/<int:f>.html", self.feature_page),
            ("/index/<slug>/map.html", self.map_page),
            ("/api/index/<slug>/map.json", lambda slug: jsonify(self.site.map_page(slug))),
            ("/image/<int:row>.html", self.image_page), ("/thumb/<int:row>.jpg", self.thumb),
            ("/api/store.json", lambda: jsonify(self.site.store_page())),
            ("/api/search.json", lambda: jsonify(self.site.search(_query()))),
            ("/api/index/<slug>.json", lambda slug: jsonify(self.site.features_page(slug))),
            ("/api/index/<slug>/<int:f>.json", lambda slug, f: jsonify(self.site.feature_page(slug, f))),
            ("/api/image/<int:row>.json", lambda row: jsonify(self.site.image_page(row))),
            ("/api/index/<slug>/patch/<int:row>/<int:token>.json", self.patch),
        ]

    def store_page(self) -> str:
        return render("store.html", page_path("store"), self.site.store_page(), "app")

    def search_page(self) -> str:
        return render("search.html", page_path("search"), self.site.search(_query()), "app")

    def features_page(self, slug: str) -> str:
        return render("features.html", page_path("features", slug), self.site.features_page(slug), "app")

    def feature_page(self, slug: str, f: int) -> str:
        return render("feature.html", page_path("feature", slug, f), self.site.feature_page(slug, f), "app")

    def map_page(self, slug: str) -> str:
        return render("map.html", page_path("map", slug), self.site.map_page(slug), "app")

    def image_page(self, row: int) -> str:
        return render("image.html", page_path("image", row), self.site.image_page(row), "app")

    def thumb(self, row: int) -> Response:
        self.site.row(row)
        try:
            data = self.site.thumbs.get(row)
        except SourceGone as gone:
            raise NotFound(str(gone)) from None
        return Response(data, mimetype="image/jpeg", headers={"Cache-Control": "max-age=3600"})

    def patch(self, slug: str, row: int, token: int) -> Response:
        return jsonify(self.site.patch_features(slug, row, token))


def _query() -> str:
    return request.args.get("q", "")[:200]


def _foreign(hosts: Hosts) -> Response | None:
    """The 403 answer to a request for a host the app does not answer for (None: it does)."""
    header = request.headers.get("Host", "")
    if hosts.allows(header):
        return None
    return Response(hosts.refusal(header) + "\n", status=403, mimetype="text/plain")


def _made_again(store: ActivationStore) -> tuple[Any, int] | None:
    """The 410 answer to a request (but for the app's own files) once the store at the viewer's URL is no longer the
    one it opened (None: it is)."""
    if request.path.startswith("/static/"):
        return None
    try:
        store.check_current()
    except StoreError:
        return _answer(f"{store.url} was made again (or removed) since this viewer opened it: restart the viewer "
                       f"(extractor view {store.url}) to see it as it is now", 410, "The store was made again")
    return None


def _headers(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


def _missing(reason: str) -> tuple[Any, int]:
    """The 404 answer: JSON under api/, else the not-found page."""
    return _answer(reason, 404)


def _answer(reason: str, status: int, heading: str | None = None) -> tuple[Any, int]:
    """A refusal saying ``reason`` in one line: JSON under api/, plain text for a thumbnail, else a page (``heading``:
    a refusal that no link of the store's pages can mend, such as a store made again; None: not found)."""
    if request.path.startswith("/api/"):
        return jsonify({"error": heading.lower() if heading else "not found", "reason": reason}), status
    if request.path.startswith("/thumb/") and heading:
        return Response(reason + "\n", status=status, mimetype="text/plain"), status
    page = {"title": heading.lower() if heading else "not found", "reason": reason, "heading": heading,
            "gone": heading is not None}
    return render("missing.html", request.path.lstrip("/") or "index.html", page, "app"), status


def serve(store: ActivationStore | str, host: str = HOST, port: int = PORT, announce: Any = print,
          live: bool = True, device: str = "auto") -> None:
    """Serve the viewer of ``store`` until interrupted; ``announce`` gets the address once it listens (port 0: a
    free one). It answers for the host it listens on only (:class:`~.hosts.Hosts`). A port outside 0 to 65535 is
    a ValueError; one that cannot be had (in use) an ExtractorError naming it. ``live``, ``device``: see
    :func:`create_app`."""
    from werkzeug.serving import make_server

    sock = listen(host, port)  # bound here: Werkzeug's own bind prints its error and exits the process
    with sock:
        bound = sock.getsockname()[0]
        server = make_server(host, port, create_app(store, Hosts.bound(host, bound), live, device), threaded=True,
                             fd=sock.fileno())  # the server listens on a copy of it
    shown = f"[{host}]" if ":" in host else host
    announce(f"http://{shown}:{server.port}/")
    try:
        server.serve_forever()
    finally:
        server.server_close()
