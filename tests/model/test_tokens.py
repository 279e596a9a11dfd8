"""Which positions of a layer's tokens are patches (issue 54, item 4): a fact of each captured layer (its length
against the patch grid; the positions a blank and a noise image give alike where sequences of that length first
appear), recorded per capture and read back from that record by every reader. Against the libraries' own word:
timm's CaiT and XCiT (the class token joins only in their last blocks: ``forward_intermediates`` gives the blocks'
patch tokens) and Hugging Face YOLOS (its detection tokens come after the patches: ``output_hidden_states``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.images import make_images
from helpers.jobs import job

from extractor.compute.worker import Worker
from extractor.driver.runner import run
from extractor.errors import LayerError, StoreError
from extractor.index.feed import Layout
from extractor.index.post_hoc import index
from extractor.model import Claim, TokenFacts, TokenLayout, Unknown, layer_tokens
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.view.site import Site

DATA = {"resize": 64, "crop": 64, "preprocess": "imagenet", "shard_size": 4, "batch_size": 2}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tokens") / "imgs"
    make_images(root, per_class=2, classes=("a", "b"), size=48)
    return root


def _inputs(raw: dict) -> tuple[torch.Tensor, torch.nn.Module]:
    """The normalised pixels the job feeds the model, in the store's row order, and the model (its worker's)."""
    worker = Worker(parse_spec(raw))
    s = open_store(raw["output"]["store"])
    pixels = torch.stack([worker.decode(str(p)) for p in s.paths])
    x = (pixels.float() / 255 - worker.mean) / worker.std
    worker.close()
    return x, worker.model


def _layer(before: int, after: int = 0, patches: int = 16, grid: list[int] | None = None) -> dict:
    return {"before": before, "patches": patches, "after": after, "grid": grid or [4, 4]}


# ------------------------------------------------------------------------------------------- the rule alone
def _mask(before: int, patches: int, after: int) -> tuple[bool, ...]:
    return (True,) * before + (False,) * patches + (True,) * after


FACTS = TokenFacts(16, 32, 22, (4, 4), {16: (False,) * 16, 17: _mask(1, 16, 0), 22: _mask(1, 16, 5),
                                        18: (False,) * 18})  # 18: its first layer's extra tokens depend on the image


def test_each_length_is_decided_by_its_own_facts_and_checked_against_what_is_said():
    none, library, user = Claim(None, "the library's num_prefix_tokens"), Claim(1, "the library's num_prefix_tokens"), \
        Claim(6, "model.prefix_tokens")
    assert layer_tokens(16, FACTS, user) == TokenLayout(0, 16, 0, (4, 4))  # all patches, whatever is said
    assert layer_tokens(22, FACTS, none) == layer_tokens(22, FACTS, library) == TokenLayout(1, 16, 5, (4, 4))
    assert layer_tokens(17, FACTS, library) == TokenLayout(1, 16, 0, (4, 4))
    wrong = layer_tokens(22, FACTS, user)
    assert isinstance(wrong, Unknown) and wrong.contradicted and wrong.fix == "set model.prefix_tokens to 1"
    assert "are 1 before and 5 after them" in wrong.why and "model.prefix_tokens says 6" in wrong.why
    assert layer_tokens(18, FACTS, Claim(2, "model.prefix_tokens")) == TokenLayout(2, 16, 0, (4, 4))
    unknown = layer_tokens(18, FACTS, library)
    assert isinstance(unknown, Unknown) and not unknown.contradicted and "2 more, which no fact places" in unknown.why
    assert layer_tokens(1, FACTS, library) is None and layer_tokens(40, FACTS, library) is None  # not of the grid
    no_grid = TokenFacts(None, None, None)
    assert layer_tokens(50, no_grid, library) == TokenLayout(1, 49, 0, None)  # nothing to check the count against
    assert isinstance(layer_tokens(50, no_grid, none), Unknown)


# ------------------------------------------------------------------------------------------- timm: CaiT, XCiT
TIMM = {  # class token only in the last blocks: blocks.* are 16 patches, norm is CLS + 16 patches
    "cait": {"name": "timm:cait_xxs24_224", "kwargs": {"img_size": 64, "depth": 2, "depth_token_only": 1}},
    "xcit": {"name": "timm:xcit_nano_12_p16_224", "kwargs": {"img_size": 64, "depth": 2, "cls_attn_layers": 1}},
}


@pytest.mark.parametrize("prefix", ["auto", 1])
@pytest.mark.parametrize("name", list(TIMM))
def test_cait_and_xcit_store_in_every_layer_the_patch_tokens_timm_gives(name: str, prefix, images: Path,
                                                                         tmp_path: Path):
    """Before: with model.prefix_tokens: 1 (what the refusal of auto asked for) drop_prefix cut a patch of every
    block; with auto the job was refused."""
    pytest.importorskip("timm")
    raw = job(images, tmp_path / "s.zarr", model={**TIMM[name], "weights": None, "device": "cpu",
                                                  "prefix_tokens": prefix}, data=DATA,
              capture=[{"layer": "blocks.*", "drop_prefix": True, "key": "{layer}"},
                       {"layer": "norm", "key": "norm"},
                       {"layer": "norm", "drop_prefix": True, "key": "norm.patches"},
                       {"layer": "norm", "reduce": "cls", "key": "cls"}])
    assert run(parse_spec(raw)).ok == 4
    s = open_store(str(tmp_path / "s.zarr"))
    x, model = _inputs(raw)
    with torch.no_grad():
        blocks = model.forward_intermediates(x, output_fmt="NLC", intermediates_only=True)
        final = model.forward_features(x)
    assert len(blocks) == 2 and final.shape[1] == 17 and model.num_prefix_tokens == 1
    for i, want in enumerate(blocks):  # the patch tokens of each block, as timm gives them
        np.testing.assert_allclose(s.numpy(f"blocks.{i}"), want.numpy(), atol=1e-5, rtol=1e-4)
        assert s.captures[f"blocks.{i}"]["tokens"] == _layer(0) and s.token_span(f"blocks.{i}", True) == (0, 16)
    np.testing.assert_allclose(s.numpy("norm"), final.numpy(), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(s.numpy("norm.patches"), final[:, model.num_prefix_tokens:].numpy(), atol=1e-5,
                               rtol=1e-4)
    np.testing.assert_allclose(s.numpy("cls"), final[:, 0].numpy(), atol=1e-5, rtol=1e-4)
    assert s.captures["norm"]["tokens"] == _layer(1) and s.token_span("norm", True) == (1, 16)
    assert s.model["prefix_tokens"] == 0  # the blocks' sequence, most of the model's


def test_a_class_token_asked_of_a_layer_that_has_none_is_refused(images: Path, tmp_path: Path):
    pytest.importorskip("timm")
    raw = job(images, tmp_path / "s.zarr", model={**TIMM["cait"], "weights": None, "device": "cpu"}, data=DATA,
              capture=[{"layer": "blocks.1", "reduce": "cls"}])
    with pytest.raises(LayerError, match=r"capture\[0\] blocks.1: layer 'blocks.1' gives 16 patches only: reduce: "
                                         r"cls takes the first token, a patch here"):
        run(parse_spec(raw))


# ------------------------------------------------------------------------------------------- Hugging Face YOLOS
@pytest.fixture(scope="module")
def yolos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A small random YOLOS (CLS, 16 patches of a 32-pixel image, 5 detection tokens) saved with save_pretrained."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   image_size=[32, 32], patch_size=8, num_detection_tokens=5)
    model = transformers.YolosModel(cfg).eval()
    folder = tmp_path_factory.mktemp("yolos") / "hf"
    model.save_pretrained(folder)
    return folder, model


def _yolos_job(images: Path, store: Path, folder: Path, capture: list[dict], **model) -> dict:
    return job(images, store, model={"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu", **model},
               data={**DATA, "resize": 32, "crop": 32}, capture=capture)


def test_yolos_detection_tokens_after_the_patches_are_no_patches_to_any_reader(yolos, images: Path, tmp_path: Path):
    """Before: the store recorded 6 prefix tokens; drop_prefix kept 11 patches and the 5 detection tokens."""
    folder, model = yolos
    raw = _yolos_job(images, tmp_path / "s.zarr", folder, [
        {"layer": "encoder.layer.*", "key": "{layer}"},
        {"layer": "encoder.layer.1", "drop_prefix": True, "key": "patches"},
        {"layer": "encoder.layer.1", "drop_prefix": True, "reduce": "mean", "key": "mean"},
        {"layer": "encoder.layer.1", "sample_tokens": 5, "seed": 2, "key": "sampled"}])
    assert run(parse_spec(raw)).ok == 4
    s = open_store(str(tmp_path / "s.zarr"))
    x, _ = _inputs(raw)
    with torch.no_grad():
        hidden = [h.numpy() for h in model(pixel_values=x, output_hidden_states=True).hidden_states]
    last, patches = hidden[2], hidden[2][:, 1:17]  # YOLOS: CLS, the 4 x 4 patches, then the detection tokens
    assert last.shape[1] == 22 and s.model["prefix_tokens"] == 1
    for i in range(2):
        np.testing.assert_allclose(s.numpy(f"encoder.layer.{i}"), hidden[i + 1], atol=1e-5, rtol=1e-4)
        assert s.captures[f"encoder.layer.{i}"]["tokens"] == _layer(1, 5)
    np.testing.assert_allclose(s.numpy("patches"), patches, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(s.numpy("mean"), patches.mean(1), atol=1e-5, rtol=1e-4)
    # sampled: the CLS in front, 5 patches drawn, the detection tokens after them; each at its own position
    where = s.numpy("sampled.token_index").astype(np.int64)
    assert s.captures["sampled"]["prefix_kept"] == 1 and s.captures["sampled"]["suffix_kept"] == 5
    assert (where[:, 0] == 0).all() and (where[:, 6:] == np.arange(17, 22)).all()
    assert ((where[:, 1:6] >= 1) & (where[:, 1:6] < 17)).all()
    np.testing.assert_allclose(s.numpy("sampled"), np.take_along_axis(last, where[:, :, None], 1), atol=1e-5,
                               rtol=1e-4)
    # the readers: a stream without the tokens besides the patches, xarray's patch coordinate, the index's heatmap
    for key in ("encoder.layer.1", "patches", "sampled"):
        seen = {}
        for idx, data in s.token_batches(key, 7, shuffle=False, drop_prefix=True):
            seen.update({(int(r), int(t)): v for (r, t), v in zip(idx, data, strict=True)})
        want = 16 if key != "sampled" else 5
        assert len(seen) == 4 * want and all(1 <= t < 17 for _, t in seen), key
        for (r, t), v in seen.items():
            np.testing.assert_allclose(v, last[r, t], atol=1e-5, rtol=1e-4)
    ds = s.to_xarray()
    mask = ds["encoder.layer.1.patch"].values
    assert list(mask) == [False] + [True] * 16 + [False] * 5
    assert list(s.to_xarray(stack=["encoder.layer.0", "encoder.layer.1"])["patch"].values) == list(mask)
    np.testing.assert_allclose(ds["encoder.layer.1"].isel({"encoder.layer.1.token": mask}).values, patches,
                               atol=1e-5, rtol=1e-4)
    assert Layout.of("encoder.layer.1", s.captures["encoder.layer.1"], 1) == Layout("tokens", 32, 16, (4, 4), 0, 1,
                                                                                  "patches")
    assert Layout.of("encoder.layer.1", s.captures["encoder.layer.1"], 1, include_prefix=True) == \
        Layout("tokens", 32, 22, (4, 4), 1, 0, "all")
    # the statistics of the patches alone: the detection tokens after them are not patches either
    tokens = last[:, 1:17].reshape(-1, last.shape[-1]).astype(np.float64)
    np.testing.assert_allclose(s.stats["encoder.layer.1"]["patches"]["mean"], tokens.mean(0), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(s.stats["encoder.layer.1"]["patches"]["mean_token_l2"],
                               np.linalg.norm(tokens, axis=1).mean(), rtol=1e-4)
    ix = index(s, "encoder.layer.1", k=2)
    site = Site(open_store(str(tmp_path / "s.zarr")))  # the viewer's pages
    for f in (0, 7):
        row = int(ix.top(f).rows[0])
        np.testing.assert_allclose(ix.heatmap(f, 0), last[row, 1:17, f].reshape(4, 4), atol=1e-5, rtol=1e-4)
        heat = site.feature_page("encoder.layer.1", f)["top"][0]["heat"]
        assert heat["grid"] == [4, 4]
        np.testing.assert_allclose(heat["values"], last[row, 1:17, f], atol=1e-5, rtol=1e-3)


def test_a_stated_count_the_facts_contradict_is_refused_naming_the_layer(yolos, images: Path, tmp_path: Path):
    folder, _ = yolos
    raw = _yolos_job(images, tmp_path / "s.zarr", folder, [{"layer": "encoder.layer.0"}], prefix_tokens=6)
    with pytest.raises(LayerError, match=r"capture\[0\] encoder.layer.0: layer 'encoder.layer.0': its 6 tokens besides "
                                         r"the 16 patches are 1 before and 5 after them .* but model.prefix_tokens "
                                         r"says 6 before them. set model.prefix_tokens to 1"):
        run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()


def test_patch_tokens_of_a_layer_no_fact_places_are_refused_until_the_count_is_given(images: Path, tmp_path: Path):
    """A token made of the image in front of the patches: nothing tells it from a patch."""
    model = {"name": None, "factory": "toy_models:pooled_token_net", "weights": None, "device": "cpu"}
    raw = job(images, tmp_path / "s.zarr", model=model, data={**DATA, "resize": 32, "crop": 32},
              capture=[{"layer": "blocks.1", "key": "whole"}, {"layer": "blocks.1", "drop_prefix": True, "key": "p"}])
    with pytest.raises(LayerError, match=r"capture\[1\] p: layer 'blocks.1': 17 tokens for a grid of 16 patches: 1 "
                                         r"more, which no fact places .* drop_prefix keeps its patch tokens: set "
                                         r"model.prefix_tokens to 1 if all 1 come before the patches"):
        run(parse_spec(raw))
    raw["capture"] = raw["capture"][:1]  # stored whole: which tokens are patches is recorded as not known
    assert run(parse_spec(raw)).ok == 4
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.captures["whole"]["tokens"] is None and "whole.patch" not in s.to_xarray().coords
    with pytest.raises(StoreError, match=r"which of 'whole''s tokens are patches is not known .* e.g. drop_prefix=1"):
        s.token_span("whole", True)
    assert Layout.of("whole", s.captures["whole"], 0).grid is None
    raw["model"]["prefix_tokens"] = 1
    raw["capture"] = [{"layer": "blocks.1", "drop_prefix": True, "key": "p"}]
    raw["output"]["if_exists"] = "overwrite"
    assert run(parse_spec(raw)).ok == 4
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.captures["p"]["tokens"] == _layer(1) and s["p"].shape[1:] == (16, 16)
