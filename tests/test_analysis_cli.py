"""`extractor show`, `probe` and `inspect` on awkward stores: one-line errors, honest numbers, tidy pictures."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.images import make_images
from helpers.jobs import job

from extractor.cli import main
from extractor.driver.runner import run
from extractor.spec.load import parse_spec


def _store(tmp: Path, name: str, root: Path) -> str:
    raw = job(root, tmp / name, data={"resize": None, "crop": 32, "shard_size": 4, "batch_size": 4},
              capture=[{"layer": "avgpool", "reduce": "flatten", "key": "emb"}],
              output={"store": str(tmp / name), "chunk_rows": 4})
    run(parse_spec(raw))
    return str(tmp / name)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A store of 6 ok rows in 2 classes, and one whose 4 rows all failed (undecodable files)."""
    tmp = tmp_path_factory.mktemp("analysis_cli")
    make_images(tmp / "imgs", per_class=3, classes=("a", "b"), size=40)
    for c in ("a", "b"):
        (tmp / "junk" / c).mkdir(parents=True)
        for i in range(2):
            (tmp / "junk" / c / f"a_rather_long_file_name_{i}.jpg").write_bytes(b"not a jpeg")
    return _store(tmp, "ok.zarr", tmp / "imgs"), _store(tmp, "failed.zarr", tmp / "junk")


def test_show_creates_the_output_folder_and_names_a_bad_file_type(stores, tmp_path: Path, capsys):
    ok, _ = stores
    assert main(["show", ok, "--key", "emb", "--rows", "0:4", "--out", str(tmp_path / "new" / "x.png")]) == 0
    assert (tmp_path / "new" / "x.png").exists()
    assert main(["show", ok, "--rows", "0:2", "--out", str(tmp_path / "nokey.png")]) == 0  # images: no capture needed
    assert main(["show", ok, "--key", "emb", "--out", str(tmp_path / "x.foo")]) == 1
    assert "x.foo: a figure is written as .png, .pdf, .svg, .jpg, .jpeg (by the extension)" in capsys.readouterr().err
    for kind in ("pdf", "svg"):  # the same figure by extension
        assert main(["show", ok, "--key", "emb", "--rows", "0:2", "--out", str(tmp_path / f"x.{kind}")]) == 0
    assert (tmp_path / "x.pdf").read_bytes()[:4] == b"%PDF" and b"<svg" in (tmp_path / "x.svg").read_bytes()


def test_probe_names_an_unknown_key_and_lists_the_captures(stores, capsys):
    ok, _ = stores
    assert main(["probe", ok, "--keys", "nope"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {ok} has no capture 'nope'; captures: emb"


def test_probe_and_show_refuse_too_few_folds_or_rows(stores, capsys):
    ok, _ = stores
    for argv in (["probe", ok, "--folds", "1"], ["show", ok, "--key", "emb", "--max-rows", "1"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and "must be at least 2, got 1" in capsys.readouterr().err


def test_probe_chart_title_gives_the_folds_run(stores, tmp_path: Path, monkeypatch):
    import extractor.read.figures

    titles = []
    real = extractor.read.figures.bar_chart
    monkeypatch.setattr(
        extractor.read.figures, "bar_chart", lambda res, title: titles.append(title) or real(res, title)
    )
    ok, _ = stores
    assert main(["probe", ok, "--folds", "10", "--out", str(tmp_path / "p.png")]) == 0  # 3 rows a class: 3 folds
    assert titles == [f"linear probe, 3-fold accuracy: {ok}"]


def test_a_store_without_ok_rows(stores, tmp_path: Path, capsys):
    import numpy as np

    from extractor.read import image_grid, open_store

    _, failed = stores
    assert main(["show", failed, "--key", "emb", "--out", str(tmp_path / "pca.png")]) == 1
    assert capsys.readouterr().err.strip() == f"error: {failed} has no ok rows: nothing to draw (see extractor inspect)"

    assert main(["inspect", failed]) == 0
    stats = capsys.readouterr().out.split("row L2")[1]  # the statistics table
    line = next(ln for ln in stats.splitlines() if ln.startswith("emb "))
    assert line.split()[:3] == ["emb", "-", "-"]  # mean and std: nothing measured, not 0

    assert main(["show", failed, "--key", "emb", "--rows", "0:4", "--out", str(tmp_path / "rows.png")]) == 0
    fig = image_grid(open_store(failed), np.arange(4), columns=2)  # a panel each, saying why there is no image
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 4 and all(not ax.get_images() for ax in panels)
    assert all(ax.texts[0].get_text().startswith("unreadable:\nnot an image format\nPillow reads") for ax in panels)
    assert [ax.get_title() for ax in panels] == ["0: a", "1: a", "2: b", "3: b"]


def test_show_top_draws_the_images_where_a_feature_is_highest_with_their_values(stores, tmp_path: Path, capsys):
    import numpy as np
    from PIL import Image

    from extractor.read import open_store, top_rows

    ok, _ = stores
    out = tmp_path / "top.png"
    assert main(["show", ok, "--key", "emb", "--top", "5", "--k", "4", "--columns", "2", "--out", str(out)]) == 0
    assert Image.open(out).size[0] > 100  # a PNG was written (what it shows: test_figures)
    direction = tmp_path / "d.npy"
    np.save(direction, np.ones(64))  # the width of the default toy's avgpool (conftest.TINY_RESNET)
    assert main(["show", ok, "--key", "emb", "--top", str(direction), "--out", str(tmp_path / "d.png")]) == 0
    rows, values = top_rows(open_store(ok), "emb", np.ones(64), k=16)
    assert len(rows) == 6 and (np.diff(values) <= 0).all()  # every ok row, highest first
    capsys.readouterr()
    assert main(["show", ok, "--key", "emb", "--top", "nope.npy"]) == 1
    assert "--top nope.npy: no such file" in capsys.readouterr().err


def test_probe_json_gives_each_captures_accuracy_chance_and_folds(stores, capsys):
    import json

    from extractor.read import open_store, probe_store

    ok, _ = stores
    capsys.readouterr()
    assert main(["probe", ok, "--folds", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    expect = probe_store(open_store(ok), None, folds=3)  # the same deterministic folds
    assert set(got) == {"emb"} and got["emb"]["chance"] == 0.5 and len(got["emb"]["folds"]) == 3
    assert got["emb"]["accuracy"] == pytest.approx(float(expect["emb"]["accuracy"]))


def test_probe_json_with_out_keeps_stdout_json_and_compare_refuses_one_capture(stores, tmp_path: Path, capsys):
    import json

    from extractor.read import compare, open_store

    ok, _ = stores
    capsys.readouterr()
    assert main(["probe", ok, "--folds", "3", "--json", "--out", str(tmp_path / "p.svg")]) == 0
    out = capsys.readouterr()
    assert set(json.loads(out.out)) == {"emb"} and f"wrote {tmp_path / 'p.svg'}" in out.err
    assert main(["compare", f"{ok}:emb"]) == 1
    assert capsys.readouterr().err.strip().startswith("error: compare needs at least two captures")
    with pytest.raises(Exception, match=r"compare takes \(store, key\) pairs"):
        compare([f"{ok}:emb", f"{ok}:emb"])  # type: ignore[list-item]
    assert compare([(open_store(ok), "emb")] * 2).cka[0, 1] == pytest.approx(1.0)
