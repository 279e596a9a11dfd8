"""Small bar charts as inline SVG text (no plotting library, no script): a histogram with its axis labelled."""

from __future__ import annotations

from html import escape

import numpy as np

__all__ = ["histogram"]

WIDTH, HEIGHT = 520, 180
LEFT, BOTTOM, TOP = 46, 34, 22  # margins: counts on the left, bin edges below, the caption above


def histogram(counts: np.ndarray, edges: np.ndarray, xlabel: str, caption: str) -> str:
    """Bars of ``counts`` over ``edges`` (one more than counts), on a square-root scale so that rare bins show."""
    counts = np.asarray(counts, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    plot_w, plot_h = WIDTH - LEFT - 10, HEIGHT - BOTTOM - TOP
    top = max(float(counts.max()) if counts.size else 0.0, 1.0)
    bar_w = plot_w / max(len(counts), 1)
    parts = [f'<svg class="histogram" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'role="img" aria-label="{escape(xlabel)}">',
             f'<text x="{LEFT}" y="14" class="caption">{escape(caption)}</text>']
    for n, c in enumerate(counts):
        h = plot_h * np.sqrt(c / top)
        x, y = LEFT + n * bar_w, TOP + plot_h - h
        title = f"{edges[n]:.3g} to {edges[n + 1]:.3g}: {int(c)}"
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 1):.1f}" height="{h:.1f}">'
                     f"<title>{escape(title)}</title></rect>")
    base = TOP + plot_h
    parts.append(f'<line x1="{LEFT}" y1="{base}" x2="{LEFT + plot_w}" y2="{base}" class="axis"/>')
    for n in _ticks(edges):
        x = LEFT + n * bar_w
        parts.append(f'<text x="{x:.1f}" y="{base + 14}" text-anchor="middle">{edges[n]:.2g}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle">{escape(xlabel)}</text>')
    parts.append(f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{int(top)}</text>')
    parts.append(f'<text x="{LEFT - 6}" y="{base}" text-anchor="end">0</text>')
    parts.append("</svg>")
    return "".join(parts)


def _ticks(edges: np.ndarray) -> list[int]:
    """The edges to label: the whole numbers among them (log10 scales: powers of ten) when 2 to 12, else five."""
    if len(edges) < 2:
        return []
    whole = [n for n, e in enumerate(edges) if abs(e - round(e)) < 1e-6]
    if 2 <= len(whole) <= 12:
        return whole
    return [int(n) for n in np.linspace(0, len(edges) - 1, 5).round()]
