"""The viewer: a store and its feature indexes in the browser, as a local app (``extractor view STORE``) or a static
site (``--export DIR``). The top floor: it reads through ``read``, ``store`` and ``data``; Flask and Jinja2 (the
``view`` extra) are imported when it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .app import create_app, serve
    from .export import export_site
    from .hosts import Hosts
    from .site import Site

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
