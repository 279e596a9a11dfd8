"""Pages rendered from the templates shipped with the package (Jinja2, autoescaped), with links relative to the
page: the same HTML is served by the app and written by the export, and opens from disk."""

from __future__ import annotations

import posixpath
from typing import Any

try:
    from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
except ImportError as err:
    raise ImportError("the viewer needs Jinja2: pip install 'extractor[view]' (make installs it)") from err

__all__ = ["STATIC", "render"]

STATIC = ("view.css", "view.js")  # the package's static files, served under static/


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("extractor.view", "templates"), autoescape=select_autoescape(),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.policies["json.dumps_kwargs"] = {"sort_keys": True, "separators": (",", ":")}  # a page's data, compact
    env.filters["num"] = _num
    env.filters["percent"] = _percent
    return env


_ENV: Environment | None = None


def _num(value: Any) -> str:
    if value is None:
        return "–"  # noqa: RUF001 - an en dash: no value
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


def _percent(value: Any) -> str:
    return "–" if value is None else f"{100 * value:.3g}%"  # noqa: RUF001 - an en dash: no value


def render(template: str, path: str, page: dict[str, Any], mode: str) -> str:
    """The HTML of ``template`` for the page at ``path`` (as :func:`~extractor.view.site.page_path` gives it), its
    data ``page``; ``mode``: ``app`` (patches fetched on demand) or ``export`` (everything in the page)."""
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    here = posixpath.dirname(path) or "."

    def rel(target: str) -> str:
        return posixpath.relpath(target, here)

    return _ENV.get_template(template).render(page=page, rel=rel, mode=mode, path=path)
