"""Figures of a feature index (matplotlib, the ``analysis`` extra): a feature's top images with its heatmap over
each, and the firing densities of all features."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any  # ix: a reader.FeatureIndex (not imported: reader imports this)

import numpy as np

from ..errors import StoreError
from ..read import crop_like_job, figure_grid, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure


__all__ = ["density_figure", "top_figure"]


def top_figure(ix: Any, f: int, n: int | None = None, columns: int = 4, alpha: float = 0.6) -> Figure:
    """Feature ``f``'s top ``n`` (default k) images as the job saw them, its value at each position drawn over the
    image where it fires (one colour scale: 0 to the feature's highest value among them; elsewhere the image shows
    as it is), titled with rank, row and pooled value."""
    top = ix.top(f)
    if not len(top.rows):
        raise StoreError(f"feature {f} of index {ix.name} never fires: no top images to draw")
    count = min(len(top.rows), n or ix.k)
    maps = [ix.heatmap(f, r) for r in range(count)] if ix.grid is not None else None
    vmax = max(float(np.nanmax(m)) for m in maps) if maps else 1.0
    fig, axes = figure_grid(count, columns)
    shown = None
    store = ix.store
    for rank, ax in enumerate(axes):
        row = int(top.rows[rank])
        try:
            img = np.asarray(crop_like_job(store.locator(row), store))
        except (OSError, ValueError) as err:
            why = textwrap.shorten(str(err) or type(err).__name__, 66, placeholder="...")
            ax.text(0.5, 0.5, "unreadable:\n" + textwrap.fill(why, 22), ha="center", va="center", color="red",
                    fontsize="x-small", transform=ax.transAxes)
            img = None
        if img is not None:
            ax.imshow(img)
        if maps is not None and img is not None:
            fires = np.ma.masked_less_equal(maps[rank], float(ix.attrs["threshold"]))  # where it does not: the image
            shown = ax.imshow(fires, cmap="plasma", vmin=0, vmax=vmax or 1.0, alpha=alpha, interpolation="nearest",
                              extent=(-0.5, img.shape[1] - 0.5, img.shape[0] - 0.5, -0.5))
        ax.set_title(f"#{rank} row {row}: {float(top.values[rank]):.3g}", fontsize="small")
    if shown is not None:
        fig.colorbar(shown, ax=axes, shrink=0.8, label=f"feature {f} at each patch")
    d = ix.density[int(f)]
    fig.suptitle(f"{ix.name}, feature {f}: fires in {d:.2%} of tokens, {ix.density_rows[int(f)]:.2%} of images "
                 f"(top {count} by {ix.attrs['pool']})", fontsize="medium")
    return fig


def density_figure(ix: Any) -> Figure:
    """A histogram of log10 of each feature's firing density (share of tokens), the dead ones said apart."""
    density = ix.density
    alive = density[density > 0]
    fig = new_figure(6.5, 3.2)
    ax = fig.add_subplot()
    if len(alive):
        ax.hist(np.log10(alive), bins=50, color="tab:blue")
    ax.set_xlabel("log10 firing density (share of tokens where the feature is above its threshold)")
    ax.set_ylabel("features")
    ax.set_title(f"{ix.name}: {ix.features} features, {len(ix.dead)} dead (never fire) over {ix.rows} rows",
                 fontsize="medium")
    return fig
