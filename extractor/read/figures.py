"""Figures of a store, drawn with matplotlib (the ``analysis`` extra): probe accuracies, a PCA scatter, images
with captions, Grad-CAM overlays, a similarity heatmap. Each function returns a ``matplotlib.figure.Figure``
(shown as it is in a notebook; :func:`save` writes PNG, PDF or SVG by the file's extension). No pyplot: no
global state, no window, safe in threads.
"""

from __future__ import annotations

import functools
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..errors import ExtractorError, StoreError
from ..store import OK, take_rows
from .pictures import crop_like_job
from .reader import ActivationStore

if TYPE_CHECKING:
    import zarr
    from matplotlib.figure import Figure

__all__ = ["bar_chart", "gradcam_grid", "heatmap", "image_grid", "pixels", "save", "scatter_plot"]

FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def new_figure(width: float, height: float) -> Figure:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise ExtractorError("figures are drawn with matplotlib, which is not installed: pip install "
                             "'extractor[analysis]'") from None
    return _shown()(figsize=(width, height), dpi=100, layout="constrained")


@functools.cache
def _shown() -> type[Figure]:
    """A matplotlib Figure that a notebook shows as PNG (``_repr_png_``) also where pyplot was never imported:
    IPython's inline formatter for figures is installed only when pyplot's inline backend starts, so a fresh
    kernel shows a plain ``Figure`` as ``<Figure size ...>``."""
    from matplotlib.figure import Figure

    class ShownFigure(Figure):
        def _repr_png_(self) -> bytes:
            out = io.BytesIO()
            self.savefig(out, format="png")  # a Figure's own savefig draws on an Agg canvas when it has none
            return out.getvalue()

    return ShownFigure


def save(fig: Figure, out: str | Path) -> None:
    """Write ``fig`` to ``out`` (PNG, PDF, SVG or JPEG by its extension), creating its folder."""
    if Path(out).suffix.lower() not in FORMATS:
        raise ExtractorError(f"cannot write {out}: a figure is written as {', '.join(FORMATS)} (by the extension)")
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, bbox_inches="tight", pad_inches=0.1)  # nothing cut off at the edges
    except OSError as err:
        raise ExtractorError(f"cannot write {out}: {err}") from None


def pixels(fig: Figure) -> np.ndarray:
    """The figure drawn, as an (H, W, 3) uint8 array."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _short(text: str, n: int = 40) -> str:
    """``text`` of at most ``n`` characters, its middle left out (capture names differ at both ends)."""
    return text if len(text) <= n else f"{text[:n // 2 - 1]}...{text[-(n - n // 2 - 2):]}"


LEGEND_CLASSES = 30  # a scatter of more classes is coloured by class index, with a colour bar for a legend


def bar_chart(results: dict[str, dict[str, Any]], title: str) -> Figure:
    """Probe accuracy per capture: a bar each, the spread over folds as an error bar, the chance level (the
    majority class) marked on each."""
    names = list(results)
    fig = new_figure(7.5, 1.8 + 0.45 * len(names))
    ax = fig.add_subplot()
    y = np.arange(len(names))
    acc, std = [results[n]["accuracy"] for n in names], [results[n]["std"] for n in names]
    ax.barh(y, acc, xerr=std, color="tab:blue", capsize=3, label="accuracy, mean over folds (error bar: std)")
    ax.scatter([results[n]["chance"] for n in names], y, marker="|", s=300, color="tab:red", zorder=3,
               label="chance (the majority class)")
    for i, (a, sd) in enumerate(zip(acc, std, strict=True)):
        ax.text(1.03, i, f"{a:.3f} ± {sd:.3f}", va="center", fontsize="small")
    ax.set_yticks(y, [_short(n) for n in names])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.22)
    ax.set_xticks(np.linspace(0, 1, 6))
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_xlabel("held-out accuracy")
    ax.set_ylabel("capture")
    ax.set_title(_short(title, 90))
    ax.legend(loc="upper center", bbox_to_anchor=(0.45, -0.18 - 0.3 / len(names)), ncol=2, fontsize="small",
              frameon=False)
    return fig


def scatter_plot(points: np.ndarray, labels: np.ndarray, classes: Sequence[str], title: str,
                 explained: Sequence[float] | np.ndarray | None = None) -> Figure:
    """A 2-D scatter (a PCA's first two components), one colour per label, a legend of class names;
    ``explained``: each axis's share of the variance, in its label."""
    present = sorted({int(v) for v in labels})
    many = len(present) > LEGEND_CLASSES
    fig = new_figure(7 if len(present) <= 10 or many else 9, 5.5)
    ax = fig.add_subplot()
    if many:  # a legend of hundreds of names is no legend: colours by class index, a colour bar says which
        shown = ax.scatter(points[:, 0], points[:, 1], c=labels, cmap="turbo", s=10)
        fig.colorbar(shown, ax=ax, label=f"class index ({len(present)} classes)")
    else:
        from matplotlib import colormaps

        colours = [f"C{i}" for i in range(10)] if len(present) <= 10 else \
            [*colormaps["tab20"].colors, *colormaps["tab20b"].colors]  # type: ignore[attr-defined]
        for n, lab in enumerate(present):
            at = labels == lab
            name = classes[lab] if 0 <= lab < len(classes) else ("no label" if lab < 0 else str(lab))
            ax.scatter(points[at, 0], points[at, 1], s=14, label=_short(name, 30),
                       color="black" if lab < 0 else colours[n % len(colours)])
        outside = len(present) > 10
        ax.legend(title="class", fontsize="x-small" if outside else "small", markerscale=1.5,
                  **({"loc": "upper left", "bbox_to_anchor": (1.01, 1), "ncol": 1 + len(present) // 16} if outside
                     else {"loc": "best"}))
    share = [f" ({explained[i]:.0%} of the variance)" if explained is not None else "" for i in range(2)]
    ax.set_xlabel(f"PC 1{share[0]}")
    ax.set_ylabel(f"PC 2{share[1]}")
    ax.set_title(_short(title, 80))
    return fig


def figure_grid(n: int, columns: int, cell: float = 1.9) -> tuple[Figure, list[Any]]:
    columns = max(1, min(columns, n))
    n_rows = -(-n // columns)
    fig = new_figure(cell * columns, (cell + 0.3) * n_rows)
    axes = fig.subplots(n_rows, columns, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    return fig, list(axes[:n])


def image_grid(store: ActivationStore, rows: np.ndarray, columns: int = 8,
               captions: Sequence[str] | None = None) -> Figure:
    """The input images of ``rows`` as the job saw them (resized and cropped), a panel each, titled with the
    row and its class, or ``captions``."""
    if not len(rows):
        raise StoreError("no rows to draw")
    fig, axes = figure_grid(len(rows), columns)
    classes = store.classes
    for n, (ax, r) in enumerate(zip(axes, rows, strict=True)):
        try:
            ax.imshow(np.asarray(crop_like_job(store.locator(int(r)), store)))
        except (OSError, ValueError) as err:  # the reason, in the panel
            why = textwrap.shorten(str(err) or type(err).__name__, 66, placeholder="...")
            ax.text(0.5, 0.5, "unreadable:\n" + textwrap.fill(why, 22), ha="center", va="center", color="red",
                    fontsize="x-small", transform=ax.transAxes)
        lab = int(store.labels[r])
        caption = captions[n] if captions is not None else f"{r}: {classes[lab] if 0 <= lab < len(classes) else lab}"
        ax.set_title(caption, fontsize="small")
    return fig


def _rows_of(store: ActivationStore, name: str, idx: np.ndarray) -> np.ndarray:
    """Rows ``idx`` of the store's per-row array ``name`` (an extra of a gradient job)."""
    return take_rows(cast("zarr.Array", store.group[name]), idx)


def gradcam_grid(store: ActivationStore, key: str | None = None, rows: slice | None = None, columns: int = 4,
                 alpha: float = 0.5) -> Figure:
    """The input images of ``rows`` with their Grad-CAM map over them (each map scaled to its own range, as the
    colour bar says), titled with the row, the target class and its score."""
    cams = [k for k, m in store.captures.items() if m["what"] == "gradcam"]
    if key is None:
        if not cams:
            raise StoreError(f"{store.url} has no gradcam capture; add one with what: gradcam")
        key = cams[0]
    if key not in cams:
        raise StoreError(f"{key!r} is not a gradcam capture of {store.url}; gradcam captures: {cams or 'none'}")
    idx = np.arange(len(store))[rows if rows is not None else slice(0, 16)]
    idx = idx[store.status[idx] == OK]
    if not idx.size:
        raise StoreError("no ok rows in the selection")
    maps = store.numpy(key, rows=idx)
    ranges = _rows_of(store, f"{key}.range", idx)
    targets, scores = _rows_of(store, "target", idx), _rows_of(store, "target_score", idx)
    classes = store.classes if store.captures[key].get("target") == "label" else []  # else the model's classes
    fig, axes = figure_grid(len(idx), columns)
    shown: Any = None
    for ax, row, cam, (lo, hi), t, sc in zip(axes, idx, maps, ranges, targets, scores, strict=True):
        img = np.asarray(crop_like_job(store.locator(int(row)), store))
        norm = (cam - lo) / (hi - lo) if hi > lo else np.zeros_like(cam)
        ax.imshow(img)
        shown = ax.imshow(norm, cmap="turbo", vmin=0, vmax=1, alpha=alpha, interpolation="bilinear",
                          extent=(-0.5, img.shape[1] - 0.5, img.shape[0] - 0.5, -0.5))
        name = classes[t] if 0 <= t < len(classes) else f"class {t}"
        ax.set_title(f"{row}: {name} ({sc:.2f})", fontsize="small")
    fig.colorbar(shown, ax=axes, shrink=0.8, label="Grad-CAM, scaled to each image's range")
    return fig


def heatmap(matrices: dict[str, np.ndarray], names: Sequence[str], title: str) -> Figure:
    """Square matrices of similarities between captures (``names`` on both axes), a panel each (titled by its
    key: what it measures), each cell written, a colour bar each."""
    n, k = len(names), len(matrices)
    fig = new_figure((3 + 0.75 * n) * k, 2.4 + 0.65 * n)
    axes = fig.subplots(1, k, squeeze=False)[0]
    short = [f"[{i}]" for i in range(n)]
    for ax, (what, values) in zip(axes, matrices.items(), strict=True):
        shown = ax.imshow(values, cmap="viridis", vmin=min(0.0, float(np.nanmin(values))), vmax=1)
        ax.set_xticks(range(n), short)
        ax.set_yticks(range(n), [f"{s} {_short(name)}" if ax is axes[0] else s for s, name in zip(short, names,
                                                                                                  strict=True)])
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize="small",
                        color="white" if values[i, j] < 0.6 else "black")
        ax.set_title(what, fontsize="medium")
        fig.colorbar(shown, ax=ax, shrink=0.8)
    fig.suptitle(title)
    return fig
