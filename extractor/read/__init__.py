"""The analysis side: a store opened lazily (numpy, zarr), its torch and xarray views, probes, feature indexes and
figures.
Needs only numpy and zarr; torch, xarray, scikit-learn and matplotlib when their views are asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from ..store.dictionary import Dictionary, load_dictionary
    from .analysis import finite, linear_probe, pca, principal_components, probe_store, top_rows
    from .features import FeatureIndex, TopRows, index, open_index
    from .figures import bar_chart, gradcam_grid, heatmap, image_grid, scatter_plot
    from .reader import ActivationStore, open_store
    from .similarity import Comparison, compare, linear_cka

__all__ = [
    "open_store",
    "ActivationStore",
    "linear_probe",
    "probe_store",
    "pca",
    "principal_components",
    "finite",
    "image_grid",
    "scatter_plot",
    "bar_chart",
    "gradcam_grid",
    "heatmap",
    "top_rows",
    "compare",
    "Comparison",
    "linear_cka",
    "index",
    "open_index",
    "FeatureIndex",
    "TopRows",
    "Dictionary",
    "load_dictionary",
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
        "principal_components": "analysis",
        "finite": "analysis",
        "image_grid": "figures",
        "scatter_plot": "figures",
        "bar_chart": "figures",
        "gradcam_grid": "figures",
        "heatmap": "figures",
        "top_rows": "analysis",
        "compare": "similarity",
        "Comparison": "similarity",
        "linear_cka": "similarity",
        "index": "features",
        "open_index": "features",
        "FeatureIndex": "features",
        "TopRows": "features",
        "Dictionary": "features",
        "load_dictionary": "features",
    },
)
