"""mkdocs hooks of the docs site: the spec's field reference is generated from its schema when the site is built
(``<!-- spec fields -->`` in a page), never written twice."""

from __future__ import annotations

from typing import Any

MARK = "<!-- spec fields -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARK not in markdown:
        return markdown
    from extractor.spec.reference import reference_markdown

    return markdown.replace(MARK, reference_markdown())
