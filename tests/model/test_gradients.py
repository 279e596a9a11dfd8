"""Gradient and Grad-CAM captures against direct torch.autograd.grad computations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.jobs import job
from PIL import Image

from extractor.compute.worker import Worker
from extractor.data.listing import list_rows
from extractor.data.rows import plan
from extractor.driver.runner import run
from extractor.errors import DataError, SpecError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec


def tutorial_job(tmp_path: Path, double_grad: bool) -> dict:
    (tmp_path / "img").mkdir(exist_ok=True)
    Image.new("RGB", (2, 2), (255, 255, 255)).save(tmp_path / "img" / "x.png")
    return job(tmp_path / "img", tmp_path / f"t{int(double_grad)}.zarr",
               model={"name": None, "factory": "toy_models:square_mean", "device": "cpu", "channels_last": False,
                      "factory_kwargs": {"double_grad": double_grad}},
               data={"resize": None, "crop": 2, "mean": [0, 0, 0], "std": [0.5, 0.5, 0.5], "shard_size": 1},
               capture=[{"layer": "square", "what": "grad_output", "target": 0},
                        {"layer": "ident", "what": "grad_output", "target": 0},
                        {"layer": "ident", "key": "x"}],
               output={"store": str(tmp_path / f"t{int(double_grad)}.zarr"), "chunk_rows": 1})


def test_tutorial_gradients(tmp_path: Path):
    """x = [2, 2, 2, 2], y = x**2, z = mean(y): dz/dy = 0.25; with a hook doubling y's gradient, dz/dx = 2."""
    run(parse_spec(tutorial_job(tmp_path, double_grad=False)))
    s = open_store(str(tmp_path / "t0.zarr"))
    np.testing.assert_array_equal(s.numpy("x"), np.full((1, 1, 2, 2), 2.0))
    np.testing.assert_array_equal(s.numpy("square.grad"), np.full((1, 1, 2, 2), 0.25))
    np.testing.assert_array_equal(s.numpy("ident.grad"), np.full((1, 1, 2, 2), 1.0))
    assert s.group["target"][:].tolist() == [0] and s.group["target_score"][:].tolist() == [4.0]
    run(parse_spec(tutorial_job(tmp_path, double_grad=True)))
    s = open_store(str(tmp_path / "t1.zarr"))
    np.testing.assert_array_equal(s.numpy("ident.grad"), np.full((1, 1, 2, 2), 2.0))


GRAD_CAPTURES = [
    {"layer": "layer4", "what": "grad_output"},
    {"layer": "layer4.1.bn1", "what": "grad_output"},  # followed by ReLU(inplace=True)
    {"layer": "layer3", "what": "grad_output", "reduce": "mean"},
    {"layer": "layer4", "what": "gradcam", "key": "cam_layer"},
    {"layer": "layer4", "what": "gradcam", "size": "input", "key": "cam_input"},
    {"layer": "avgpool", "reduce": "flatten"},
]


def reference(paths: list[str], target: str | int, labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Independent: torchvision's feature extractor on a copy of the job's model (the default toy, resnet18's
    module tree: conftest.TINY_RESNET, seeded as extractor seeds it) without in-place ReLUs, torch.autograd.grad."""
    import torch.nn.functional as F
    from helpers.preprocess import reference_batch
    from torchvision.models.feature_extraction import create_feature_extractor
    from toy_models import tiny_resnet

    torch.manual_seed(0)  # extractor seeds random-init models with 0
    model = tiny_resnet().eval()
    for m in model.modules():
        if isinstance(m, torch.nn.ReLU):
            m.inplace = False
    fx = create_feature_extractor(model, return_nodes=["layer3", "layer4.1.bn1", "layer4", "fc"])
    x = reference_batch([Path(p) for p in paths], 72, 64)
    feats = fx(x)
    logits = feats["fc"]
    if target == "predicted":
        t = logits.argmax(1)
    elif target == "label":
        t = torch.as_tensor(labels)
    else:
        t = torch.full((len(x),), int(target))
    score = logits.gather(1, t[:, None])[:, 0]
    g4, g4bn1, g3 = torch.autograd.grad(score.sum(), [feats["layer4"], feats["layer4.1.bn1"], feats["layer3"]])
    a4 = feats["layer4"].detach()
    cam = torch.relu((g4.mean((2, 3), keepdim=True) * a4).sum(1, keepdim=True))
    up = F.interpolate(cam, size=(64, 64), mode="bilinear", align_corners=False)
    return {"layer4.grad": g4, "layer4.1.bn1.grad": g4bn1, "layer3.grad": g3.mean((2, 3)),
            "cam_layer": cam[:, 0], "cam_input": up[:, 0], "target": t, "target_score": score.detach()}


@pytest.mark.parametrize("target", ["predicted", "label", 3])
def test_grad_output_and_gradcam_equal_autograd(image_dir: Path, tmp_path: Path, target):
    caps = [dict(c, target=target) if c.get("what") in ("grad_output", "gradcam") else c for c in GRAD_CAPTURES]
    summary = run(parse_spec(job(image_dir, tmp_path / "g.zarr", capture=caps)))
    assert summary.ok == 12
    s = open_store(str(tmp_path / "g.zarr"))
    ref = reference(list(s.paths), target, s.labels)
    for key in ("layer4.grad", "layer4.1.bn1.grad", "layer3.grad", "cam_layer", "cam_input", "target_score"):
        got = s.numpy(key) if key in s.captures else s.group[key][:]
        want = ref[key].detach().numpy()
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * scale, err_msg=key)
    np.testing.assert_array_equal(s.group["target"][:], ref["target"].numpy())
    rng = s.group["cam_input.range"][:]
    np.testing.assert_allclose(rng[:, 0], ref["cam_input"].amin((1, 2)).numpy(), rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(rng[:, 1], ref["cam_input"].amax((1, 2)).numpy(), rtol=1e-3, atol=1e-6)
    assert s.captures["cam_input"]["shape"] == [64, 64] and s.captures["cam_layer"]["shape"] == [2, 2]
    assert s.captures["layer4.grad"]["target"] == target


def test_batch_of_8_equals_8_batches_of_1(image_dir: Path, tmp_path: Path):
    caps = [{"layer": "layer4", "what": "grad_output"}, {"layer": "layer4", "what": "gradcam", "key": "cam"}]
    run(parse_spec(job(image_dir, tmp_path / "a.zarr", capture=caps,
                       data={"batch_size": 8, "shard_size": 8}, output={"store": str(tmp_path / "a.zarr"),
                                                                       "chunk_rows": 4})))
    run(parse_spec(job(image_dir, tmp_path / "b.zarr", capture=caps, data={"batch_size": 1, "shard_size": 8},
                       output={"store": str(tmp_path / "b.zarr"), "chunk_rows": 4})))
    a, b = open_store(str(tmp_path / "a.zarr")), open_store(str(tmp_path / "b.zarr"))
    for key in ("layer4.grad", "cam"):
        np.testing.assert_allclose(a.numpy(key), b.numpy(key), rtol=1e-4, atol=1e-6)


def test_no_hooks_no_parameter_grads_no_graph_after_a_job(image_dir: Path, tmp_path: Path):
    spec = parse_spec(job(image_dir, tmp_path / "s.zarr", capture=GRAD_CAPTURES))
    worker = Worker(spec)
    rows = list_rows(spec.data)
    from extractor.store.layout import StoreArrays
    from extractor.store.synthetic import create_store, ticket

    probe = worker.probe()
    create_store(str(tmp_path / "s.zarr"), rows, StoreArrays(captures=probe.captures, extras=probe.extras,
                                                             shard_size=4, chunk_rows=dict.fromkeys(probe.captures, 2)),
                 attrs={"n_rows": len(rows), "n_shards": 3, "captures": probe.captures}, pending=True)
    worker.run_shard(plan(len(rows), 4)[0], str(tmp_path / "s.zarr"), ticket=ticket(str(tmp_path / "s.zarr")))
    worker.close()
    for m in worker.model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    assert all(p.grad is None for p in worker.model.parameters())
    assert not worker.model.training


def test_label_target_needs_labels_and_targets_must_agree(tmp_path: Path):
    from helpers.images import make_images

    root = tmp_path / "flat"
    root.mkdir()
    make_images(root, per_class=2, classes=("c",))
    for p in (root / "c").iterdir():
        p.rename(root / p.name)  # no class folders: no labels
    raw = job(root, tmp_path / "s.zarr", capture=[{"layer": "layer4", "what": "gradcam", "target": "label"}])
    with pytest.raises(DataError, match="target: label needs a label on every row"):
        run(parse_spec(raw))
    files = sorted(p.name for p in root.iterdir())
    labels = [3, 5000, 7, 9][: len(files)]
    lines = [f"{f},{lab}\n" for f, lab in zip(files, labels, strict=True)]
    (tmp_path / "m.csv").write_text("path,label\n" + "".join(lines))
    raw = job(root, tmp_path / "m.zarr", data={"source": "manifest", "manifest": str(tmp_path / "m.csv")},
              capture=[{"layer": "layer4", "what": "gradcam", "target": "label"}])
    with pytest.raises(DataError, match=rf"model has outputs for \(0 to 9\), but 1 rows have larger ones "
                                        rf"\(first: {files[1]}, label 5000\)"):
        run(parse_spec(raw))  # before anything is written (it failed every shard, blaming missing labels)
    assert not (tmp_path / "m.zarr").exists()
    with pytest.raises(SpecError, match="must share one target"):
        parse_spec(job(root, tmp_path / "s.zarr", capture=[{"layer": "layer4", "what": "gradcam", "target": 1},
                                                          {"layer": "layer3", "what": "grad_output"}]))
    with pytest.raises(SpecError, match="target applies only"):
        parse_spec(job(root, tmp_path / "s.zarr", capture=[{"layer": "layer4", "target": 1}]))


def test_show_draws_gradcam_overlays(image_dir: Path, tmp_path: Path):
    from PIL import Image as PILImage

    from extractor.cli import main

    raw = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer4", "what": "gradcam", "target": "predicted",
                                                        "size": "input", "key": "cam"}])
    run(parse_spec(raw))
    out = tmp_path / "cams.png"
    assert main(["show", str(tmp_path / "s.zarr"), "--rows", "0:6", "--out", str(out), "--columns", "3"]) == 0
    assert PILImage.open(out).size[0] > 3 * 64
    # each panel: the image as the job saw it, under the map scaled to its own range; one colour bar for all
    s = open_store(str(tmp_path / "s.zarr"))
    from extractor.read import gradcam_grid
    from extractor.read.pictures import crop_like_job as _crop_like_job

    fig = gradcam_grid(s, rows=slice(0, 6), columns=3)
    panels = [ax for ax in fig.axes if ax.get_images() and ax.get_title()]
    assert len(panels) == 6 and len(fig.axes) == 6 + 1  # and the colour bar's
    bar = next(ax for ax in fig.axes if ax not in panels)
    assert bar.get_ylabel() == "Grad-CAM, scaled to each image's range"
    bare = np.asarray(_crop_like_job(str(s.paths[0]), s))
    image, heat = panels[0].get_images()
    np.testing.assert_array_equal(image.get_array(), bare)
    cam, (lo, hi) = s.numpy("cam", rows=[0])[0], s.numpy("cam.range", rows=[0])[0]
    np.testing.assert_allclose(heat.get_array(), (cam - lo) / (hi - lo), rtol=1e-6)
    target = int(s.numpy("target", rows=[0])[0])
    assert panels[0].get_title().startswith(f"0: class {target} (")
    assert main(["show", str(tmp_path / "s.zarr"), "--key", "nope", "--out", str(out)]) == 1
