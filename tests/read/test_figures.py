"""Figures (issue 31), drawn with matplotlib: each checked for what it must show (axes labels, legend entries,
panels, colour bars, the numbers written on it); PCA against an SVD computed here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import job

from extractor.cli import main
from extractor.driver.runner import run
from extractor.read import bar_chart, compare, heatmap, image_grid, open_store, principal_components, scatter_plot
from extractor.spec.load import parse_spec

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def store(image_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("figures")
    raw = job(image_dir, tmp / "s.zarr", capture=[{"layer": "layer3", "reduce": "mean"},
                                                   {"layer": "layer4", "reduce": "mean"}])
    run(parse_spec(raw))
    return open_store(str(tmp / "s.zarr"))


def test_probe_bars_show_accuracy_spread_and_chance():
    results = {"layer3": {"accuracy": 0.8, "std": 0.05, "chance": 0.5}, "layer4": {"accuracy": 0.95, "std": 0.02,
                                                                                    "chance": 0.5}}
    fig = bar_chart(results, "a probe")
    [ax] = fig.axes
    assert ax.get_xlabel() == "held-out accuracy" and ax.get_ylabel() == "capture" and ax.get_title() == "a probe"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["layer3", "layer4"]
    assert [round(p.get_width(), 3) for p in ax.patches] == [0.8, 0.95]  # a bar each
    assert [t.get_text() for t in ax.texts] == ["0.800 ± 0.050", "0.950 ± 0.020"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["chance (the majority class)", "accuracy, mean over folds (error bar: std)"]
    chance = ax.collections[-1].get_offsets()  # the chance marks, at 0.5 on each bar
    np.testing.assert_allclose(np.asarray(chance)[:, 0], [0.5, 0.5])


def test_pca_scatter_has_a_legend_of_class_names_and_the_variance_on_its_axes(store):
    x = store.numpy("layer4")
    points, explained = principal_components(x)
    centred = x - x.mean(axis=0)
    _u, s, vt = np.linalg.svd(centred, full_matrices=False)  # PCA computed here
    for i in range(2):
        ref = centred @ vt[i]
        np.testing.assert_allclose(np.abs(points[:, i]), np.abs(ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(explained, (s**2 / (s**2).sum())[:2], rtol=1e-5)
    fig = scatter_plot(points, store.labels, store.classes, "PCA", explained)
    [ax] = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["cats", "dogs"]
    assert ax.get_xlabel() == f"PC 1 ({explained[0]:.0%} of the variance)" and ax.get_ylabel().startswith("PC 2 (")
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(store)


def test_many_classes_are_coloured_by_index_and_long_names_are_shortened():
    from extractor.read.figures import LEGEND_CLASSES

    rng = np.random.default_rng(0)
    labels = rng.integers(0, LEGEND_CLASSES + 5, 300)
    [ax, bar] = scatter_plot(rng.normal(size=(300, 2)), labels, [f"c{i}" for i in range(40)], "t").axes
    assert ax.get_legend() is None and bar.get_ylabel() == f"class index ({len(set(labels.tolist()))} classes)"
    fig = scatter_plot(rng.normal(size=(300, 2)), labels % 25, [f"c{i}" for i in range(25)], "t")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [f"c{i}" for i in range(25)]
    long = {"a" * 60 + str(i): {"accuracy": 0.5, "std": 0.0, "chance": 0.5} for i in range(2)}
    ticks = [t.get_text() for t in bar_chart(long, "t").axes[0].get_yticklabels()]
    assert ticks == ["a" * 19 + "..." + "a" * 17 + "0", "a" * 19 + "..." + "a" * 17 + "1"]  # both ends kept


def test_image_grid_has_a_titled_panel_per_row(store):
    fig = image_grid(store, np.arange(5), columns=2, captions=[f"c{i}" for i in range(5)])
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(fig.axes) == 6 and len(shown) == 5  # 3 rows of 2, the last cell empty
    assert [ax.get_title() for ax in shown] == ["c0", "c1", "c2", "c3", "c4"]
    assert all(ax.get_images()[0].get_array().shape == (64, 64, 3) for ax in shown)  # the crop the job saw


def test_compare_heatmaps_show_both_measures_with_their_sample_and_colour_bars(store, tmp_path: Path, capsys):
    result = compare([(store, "layer3"), (store, "layer4")])
    fig = result.figure()
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 2 and len(fig.axes) == 4  # two matrices, a colour bar each
    assert [ax.get_title() for ax in panels] == [f"linear CKA ({result.cka_rows} rows)",
                                                f"RSA: Spearman of RDMs ({result.rsa_rows} rows)"]
    assert [t.get_text() for t in panels[0].texts] == [f"{v:.2f}" for v in result.cka.ravel()]
    ticks = [t.get_text() for t in panels[0].get_yticklabels()]  # long names: their middle left out
    assert [t[:4] for t in ticks] == ["[0] ", "[1] "] and ticks[0].endswith("s.zarr:layer3") and len(ticks[0]) <= 44
    one = heatmap({"m": np.eye(3)}, ["a", "b", "c"], "t")
    assert len(one.axes) == 2 and one.axes[0].get_title() == "m"
    out = tmp_path / "c.svg"
    assert main(["compare", f"{store.url}:layer3", f"{store.url}:layer4", "--out", str(out)]) == 0
    assert b"<svg" in out.read_bytes() and f"wrote {out}" in capsys.readouterr().out


def test_figures_show_as_png_where_pyplot_was_never_imported():
    """A returned figure has a PNG representation of its own: a notebook shows it without pyplot's inline
    backend (a fresh kernel showed ``<Figure size ...>``)."""
    fig = bar_chart({"a": {"accuracy": 0.8, "std": 0.05, "chance": 0.5}}, "a probe")
    png = fig._repr_png_()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


@pytest.mark.slow
def test_a_fresh_notebook_kernel_renders_a_figure_as_png():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    code = ("from extractor.read import bar_chart\n"
            "bar_chart({'a': {'accuracy': 0.8, 'std': 0.05, 'chance': 0.5}}, 'a probe')")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3").execute()
    [out] = nb.cells[0].outputs
    assert out["output_type"] == "execute_result" and "image/png" in out["data"], out
