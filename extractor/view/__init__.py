"""The viewer: a store and its feature indexes in the browser, as a local app (``extractor view STORE``) or a static
site (``--export DIR``). The top floor: it reads through ``read``, ``store`` and ``data``; Flask and Jinja2 (the
``view`` extra) are imported when it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from .app import create_app, serve
    from .export import export_site
    from .site import Site

__all__ = ["create_app", "serve", "export_site", "Site"]

__getattr__ = face(__name__, {"create_app": "app", "serve": "app", "export_site": "export", "Site": "site"})
