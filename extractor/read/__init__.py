"""The analysis side: a store opened lazily (numpy, zarr), its torch and xarray views, probes and figures.
Needs only numpy and zarr; torch, xarray, scikit-learn and matplotlib when their views are asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .analysis import finite, linear_probe, pca, principal_components, probe_store, top_rows
    from .figures import bar_chart, figure_grid, gradcam_grid, heatmap, image_grid, new_figure, save, scatter_plot
    from .nearest import NearestRows
    from .pictures import crop_like_job
    from .reader import ActivationStore, open_store, zarr_store
    from .similarity import compare, linear_cka

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
