"""Pixels proven equal to the library's own processor, or not used (extractor.model.processors).

Tiny random-init transformers models of the five families whose processors do more than extractor
reproduces (MobileViT's channel flip, EfficientNet's second normalisation, LeViT's 256/224 resize, OWLv2's
pad to a square, DPT's per-image sizes), each saved with save_pretrained and its processor's config: left to
the library they are refused before any store exists, naming the setting or the difference; with
``data.preprocess: library`` the stored pixels and first layer equal transformers run by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.jobs import RESNET18, job

from extractor.driver.runner import run
from extractor.errors import SpecError
from extractor.model.processors import LibraryProcessor, check, probe_images
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

transformers = pytest.importorskip("transformers")

AUTO = {"resize": "auto", "crop": "auto", "interpolation": "auto", "mean": "auto", "std": "auto"}
SIZES = [(20, 28), (40, 150), (90, 61)]  # smaller than the input, very wide, tall (the last one grayscale)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(38)
    for i, (h, w) in enumerate(SIZES):
        y, x = np.mgrid[0:h, 0:w] / max(h, w)
        base = np.stack([np.sin(6 * x + i), np.cos(5 * y), x - y], -1) * 90 + 128
        img = Image.fromarray(np.clip(base + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8))
        (img.convert("L") if i == 2 else img).save(root / f"p{i}.png")
    return root


def _images(root: Path) -> list:
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in sorted(root.glob("*.png"))]


def _case(family: str):
    """A tiny random-init model, its processor (toy sizes), its first layer and what the refusal names."""
    t = transformers
    if family == "mobilevit":
        model = t.MobileViTModel(t.MobileViTConfig(image_size=32, hidden_sizes=[16, 16, 16], num_attention_heads=2,
                                                   neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16], patch_size=2))
        proc = t.MobileViTImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32})
        return model, proc, "conv_stem", r"sets do_flip_channel_order=True, which extractor does not reproduce"
    if family == "efficientnet":
        model = t.EfficientNetModel(t.EfficientNetConfig(image_size=32, width_coefficient=0.1, depth_coefficient=0.1,
                                                         hidden_dim=128))
        proc = t.EfficientNetImageProcessor(size={"height": 32, "width": 32})
        return model, proc, "embeddings", r"sets include_top=True, which extractor does not reproduce"
    if family == "levit":
        model = t.LevitModel(t.LevitConfig(image_size=32, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2],
                                           depths=[1, 1, 1], key_dim=[8, 8, 8], patch_size=16, stride=2,
                                           down_ops=[["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]]))
        proc = t.LevitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        # no setting outside the allow-list: the probe's comparison finds the 256/224 resize
        return model, proc, "patch_embeddings", r"differ from LevitImageProcessorPil of hf:.* by up to [0-9.]+ levels"
    model = t.Owlv2VisionModel(t.Owlv2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, image_size=32, patch_size=8))
    proc = t.Owlv2ImageProcessor(size={"height": 32, "width": 32})
    return model, proc, "vision_model.embeddings", r"sets do_pad=True, which extractor does not reproduce"


def _folder(tmp_path: Path, model, proc) -> Path:
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    proc.save_pretrained(folder)
    return folder


def _by_hand(folder: Path, model, layer: str, images: list) -> tuple[np.ndarray, np.ndarray]:
    """transformers run by hand: its processor's pixel values and the first layer's output on them."""
    pixel_values = transformers.AutoImageProcessor.from_pretrained(folder)(images, return_tensors="pt").pixel_values
    seen = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda m, a, out: seen.setdefault("out", out))
    with torch.no_grad():
        model(pixel_values=pixel_values)
    handle.remove()
    out = seen["out"][0] if isinstance(seen["out"], tuple) else seen["out"]
    return pixel_values.numpy(), out.numpy()


def _run(raw: dict, model=None):
    import extractor

    return extractor.run(raw, model=model, progress=False) if model is not None else \
        open_store(run(parse_spec(raw)).store)


@pytest.mark.parametrize("family", ["mobilevit", "efficientnet", "levit", "owlv2"])
def test_a_processor_extractor_does_not_reproduce_is_refused_or_run_as_it_is(family: str, photos: Path,
                                                                               tmp_path: Path):
    torch.manual_seed(0)
    model, proc, layer, refusal = _case(family)
    folder = _folder(tmp_path, model.eval(), proc)
    given = None
    model_spec = {"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu"}
    if family == "owlv2":  # OWLv2 as a module of one's own (extractor.run(..., model=)): its name_or_path's processor
        given = transformers.Owlv2VisionModel.from_pretrained(folder).eval()
        model_spec = {}
    capture = [{"layer": layer, "what": "input", "layout": "nchw", "key": "pixels"}, {"layer": layer, "key": "first"}]
    raw = job(photos, tmp_path / "auto.zarr", model=model_spec, data=AUTO, capture=capture)
    if given is not None:
        del raw["model"]
        del raw["data"]["preprocess"]  # what job() sets for its default toy model, not for a module given
    with pytest.raises(SpecError, match=refusal + r".*data\.preprocess: library runs that processor as it is"):
        _run(raw, given)
    assert not (tmp_path / "auto.zarr").exists()  # refused before any store was made

    raw = job(photos, tmp_path / "lib.zarr", model=model_spec, data={**AUTO, "preprocess": "library"},
              capture=capture)
    if given is not None:
        del raw["model"]
    s = _run(raw, given)
    assert s.attrs["preprocess"]["runs"] == "library" and "run per image on the CPU" in s.attrs["preprocess"]["source"]
    pixels, first = _by_hand(folder, model, layer, _images(photos))
    np.testing.assert_array_equal(s.numpy("pixels"), pixels)  # the processor's own pixels, exactly
    np.testing.assert_allclose(s.numpy("first"), first, atol=1e-5, rtol=1e-5)


def test_a_processor_that_sizes_each_image_its_own_way_is_refused_in_both_modes(photos: Path, tmp_path: Path):
    """DPT / Depth-Anything with keep_aspect_ratio: every image its own size (before: squashed to one)."""
    t = transformers
    torch.manual_seed(0)
    model = t.DPTModel(t.DPTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                                   image_size=32, patch_size=8, neck_hidden_sizes=[8, 8, 8, 8], fusion_hidden_size=8,
                                   backbone_out_indices=[0, 1, 2, 3]))
    proc = t.DPTImageProcessor(size={"height": 32, "width": 32}, keep_aspect_ratio=True, ensure_multiple_of=8)
    folder = _folder(tmp_path, model.eval(), proc)
    for mode in ("auto", "library"):
        raw = job(photos, tmp_path / f"{mode}.zarr", model={"name": f"hf:{folder}", "weights": "pretrained",
                                                            "device": "cpu"},
                  data={**AUTO, "preprocess": mode}, capture=[{"layer": "embeddings", "reduce": "mean"}])
        with pytest.raises(SpecError, match=r"resizes each image to its own size \(variable resolution: probe images "
                                            r"13x19, .* became 24x32, .*does not support variable-resolution"):
            run(parse_spec(raw))
        assert not (tmp_path / f"{mode}.zarr").exists()


def _vit_folder(tmp_path: Path, extra: dict | None = None):
    t = transformers
    torch.manual_seed(0)
    model = t.ViTModel(t.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   image_size=32, patch_size=8)).eval()
    folder = _folder(tmp_path, model, t.ViTImageProcessor(size={"height": 32, "width": 32}))
    if extra:
        path = folder / "preprocessor_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return model, folder


def test_a_processor_shown_equal_takes_the_fast_path_and_inspect_shows_the_probe(photos: Path, tmp_path: Path,
                                                                                   capsys: pytest.CaptureFixture):
    from extractor.cli import main

    _model, folder = _vit_folder(tmp_path)
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu"},
              data=AUTO,
              capture=[{"layer": "embeddings.patch_embeddings", "what": "input", "layout": "nchw", "key": "pixels"}])
    s = _run(raw)
    p = s.attrs["preprocess"]
    assert p["runs"] == "extractor" and p["check"]["against"] == f"ViTImageProcessorPil of hf:{folder}"
    assert p["check"]["measured"][p["check"]["against"]]["max_abs_levels"] <= p["check"]["tolerance_levels"]
    # the torchvision backend resizes otherwise: measured, recorded, not claimed
    assert p["check"]["measured"][f"ViTImageProcessor of hf:{folder}"]["max_abs_levels"] > 0.5
    pil = transformers.ViTImageProcessorPil.from_pretrained(folder)
    np.testing.assert_allclose(s.numpy("pixels"), pil(_images(photos), return_tensors="pt").pixel_values.numpy(),
                               atol=1e-6)
    main(["inspect", str(tmp_path / "s.zarr")])
    out = capsys.readouterr().out
    assert f"pixels  extractor's resize and crop, equal to ViTImageProcessorPil of hf:{folder} on 5 probe images " \
           "(max 0 levels, 0 normalised, tolerance 0.01 levels); ViTImageProcessor of hf:" in out


@pytest.mark.parametrize("mode", ["auto", "library"])
def test_an_unknown_processor_setting_is_refused_or_the_processor_runs_as_it_is(mode: str, photos: Path,
                                                                                 tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture):
    """A setting extractor does not know, added by hand to a ViT processor's config: never silently ignored."""
    from extractor.cli import main

    model, folder = _vit_folder(tmp_path, {"do_sharpen_edges": True})
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu"},
              data={**AUTO, "preprocess": mode},
              capture=[{"layer": "embeddings.patch_embeddings", "what": "input", "layout": "nchw", "key": "pixels"},
                       {"layer": "embeddings", "key": "first"}])
    if mode == "auto":
        with pytest.raises(SpecError, match=r"ViTImageProcessor of hf:.* sets do_sharpen_edges=True, which extractor "
                                            r"does not reproduce .*data\.preprocess: library.* cannot be 'auto'"):
            run(parse_spec(raw))
        assert not (tmp_path / "s.zarr").exists()
        return
    s = _run(raw)
    assert s.attrs["preprocess"]["check"]["unknown"] == ["do_sharpen_edges=True"]
    pixels, first = _by_hand(folder, model, "embeddings", _images(photos))
    np.testing.assert_array_equal(s.numpy("pixels"), pixels)
    np.testing.assert_allclose(s.numpy("first"), first, atol=1e-5, rtol=1e-5)
    main(["inspect", str(tmp_path / "s.zarr")])
    assert f"pixels  ViTImageProcessor of hf:{folder}, run per image on the CPU (data.preprocess: library)" \
        in capsys.readouterr().out


def test_the_probe_finds_a_difference_no_setting_names():
    """The comparison itself, not only the allow-list: a processor that flips channels with no setting saying so."""
    from extractor.data import Preprocess

    ours = Preprocess(resize=(16, 16), crop=None, interpolation="bilinear", mean=(0.5,) * 3, std=(0.5,) * 3)

    def flipped(img):
        return ((torch.from_numpy(np.array(img.resize((16, 16), 2))).permute(2, 0, 1).flip(0) / 255.0) - 0.5) / 0.5

    def same(img):
        return ((torch.from_numpy(np.array(img.resize((16, 16), 2))).permute(2, 0, 1) / 255.0) - 0.5) / 0.5

    found = check(ours, LibraryProcessor("flipper", flipped))
    assert isinstance(found, str) and "differ from flipper by up to" in found
    good = check(ours, LibraryProcessor("same", same))
    assert not isinstance(good, str) and good.check["measured"]["same"]["max_abs_levels"] < 1e-3
    def needs_text(img):
        raise KeyError("pixel_values")

    assert check(ours, LibraryProcessor("texty", needs_text)) == ("the image processor texty failed on a probe image "
                                                                  "(KeyError: 'pixel_values'): extractor cannot run "
                                                                  "it per image")
    assert [im.size for im in probe_images()] == [(19, 13), (301, 24), (97, 181), (80, 64), (250, 333)]


def test_library_mode_refuses_settings_of_its_own(photos: Path, tmp_path: Path):
    raw = job(photos, tmp_path / "s.zarr", data={"preprocess": "library"})
    with pytest.raises(Exception, match=r"data\.resize is set, but data\.preprocess: library runs the model's own "
                                        r"processor as it is: remove data\.resize, data\.crop"):
        parse_spec(raw)
    raw = job(photos, tmp_path / "s.zarr", model=RESNET18, data={**AUTO, "preprocess": "library"})
    with pytest.raises(SpecError, match=r"data\.preprocess: library runs the model's own processor, but .*torchvision"):
        run(parse_spec(raw))
