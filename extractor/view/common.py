"""What the viewer's page modules share: page paths (the same in the app and the export), the 404 of what the store
does not hold, numbers for JSON, a row's strongest features."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["NotFound", "number", "numbers", "page_path", "strongest", "strongest_each"]


class NotFound(LookupError):
    """A page of something the store does not hold (an unknown index, feature or row): a 404 page."""


def page_path(kind: str, *parts: object) -> str:
    """The path of a page or file, the same in the app's URLs and in the exported site."""
    paths = {
        "store": "index.html",
        "search": "search.html",
        "features": "index/{0}.html",
        "feature": "index/{0}/{1}.html",
        "image": "image/{0}.html",
        "thumb": "thumb/{0}.jpg",
        "patch": "api/index/{0}/patch/{1}/{2}.json",
        "map": "index/{0}/map.html",
        "run": "run.html",
    }
    return paths[kind].format(*parts)


def number(value: Any, digits: int = 4) -> float | None:
    """A float for JSON (None for NaN or infinity), rounded to ``digits`` significant digits."""
    return numbers(np.asarray([value]), digits)[0]


def numbers(values: np.ndarray, digits: int = 4) -> list[float | None]:
    """:func:`number` of each value (vectorised: a page carries thousands)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = np.isfinite(v)
    nonzero = np.where(finite & (v != 0), np.abs(v), 1.0)
    scale = 10.0 ** (digits - 1 - np.floor(np.log10(nonzero)))
    rounded = (np.round(np.where(finite, v, 0) * scale) / scale).tolist()
    return [r if f else None for r, f in zip(rounded, finite.tolist(), strict=True)]


def strongest(values: np.ndarray, n: int, slug: str) -> list[dict[str, Any]]:
    """The ``n`` features of highest value above 0 (ties: the lower number first), each with its page."""
    return [{"feature": f, "value": v, "page": page_path("feature", slug, f)} for f, v in strongest_each(values, n)[0]]


def strongest_each(values: np.ndarray, n: int) -> list[list[tuple[int, float | None]]]:
    """Of each row of ``values`` (..., F), its ``n`` features of highest value above 0, highest first (ties: the
    lower number first), with their values."""
    v = np.nan_to_num(np.atleast_2d(np.asarray(values, dtype=np.float64)), nan=-np.inf)
    n = min(n, v.shape[1])
    if n == 0:
        return [[] for _ in v]
    best = np.sort(np.argpartition(-v, n - 1, axis=1)[:, :n], axis=1)  # the n highest, by feature number
    best = np.take_along_axis(best, np.argsort(-np.take_along_axis(v, best, 1), axis=1, kind="stable"), 1)
    top = np.take_along_axis(v, best, 1)
    shown = numbers(top)
    out = []
    for r in range(len(v)):
        out.append([(int(best[r, i]), shown[r * n + i]) for i in range(n) if top[r, i] > 0])
    return out
