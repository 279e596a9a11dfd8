"""The analysis side: a store opened lazily (numpy, zarr), its torch and xarray views, probes and pictures.
Needs only numpy and zarr; torch, xarray and Pillow when their views are asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from .analysis import bar_chart, finite, image_grid, linear_probe, pca, probe_store, scatter_plot, top_rows
    from .reader import ActivationStore, open_store
    from .show import gradcam_grid
    from .similarity import Comparison, compare, linear_cka

__all__ = [
    "open_store",
    "ActivationStore",
    "linear_probe",
    "probe_store",
    "pca",
    "finite",
    "image_grid",
    "scatter_plot",
    "bar_chart",
    "gradcam_grid",
    "top_rows",
    "compare",
    "Comparison",
    "linear_cka",
]

# a name of the face is never a module's name too: the module, once imported, would shadow it
__getattr__ = face(
    __name__,
    {
        "open_store": "reader",
        "ActivationStore": "reader",
        "linear_probe": "analysis",
        "probe_store": "analysis",
        "pca": "analysis",
        "finite": "analysis",
        "image_grid": "analysis",
        "scatter_plot": "analysis",
        "bar_chart": "analysis",
        "gradcam_grid": "show",
        "top_rows": "analysis",
        "compare": "similarity",
        "Comparison": "similarity",
        "linear_cka": "similarity",
    },
)
