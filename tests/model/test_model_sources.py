"""Models as their libraries make them: timm, Hugging Face transformers and open_clip, from small
random-init configs (no downloads), with the library's own preprocessing on non-square JPEGs.

Each case checks two things independently: the pixels extractor feeds the model equal the
library's own preprocessing of the same files, and the stored values equal the library's own
way of reading those layers (``output_hidden_states``, ``forward_intermediates``, ``encode_image``)
on those pixels."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.jobs import job

from extractor.compute.worker import Worker
from extractor.driver.runner import run
from extractor.errors import ModelError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
open_clip = pytest.importorskip("open_clip")

SIZES = [(97, 131), (150, 100), (64, 200), (120, 121), (333, 250)]


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Non-square JPEGs of smooth, photo-like content (resamplers differ most on noise)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(3)
    for i, (h, w) in enumerate(SIZES):
        y, x = np.mgrid[0:h, 0:w] / max(h, w)
        base = np.stack([np.sin(6 * x + i), np.cos(5 * y), np.sin(3 * x * y + 2)], -1) * 100 + 128
        arr = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=92)
        (root / f"p{i}.jpg").write_bytes(buf.getvalue())
    return root


def _files(root: Path) -> list[Path]:
    return sorted(root.glob("*.jpg"))


def _our_pixels(spec_raw: dict) -> tuple[torch.Tensor, Worker]:
    """The uint8 pixels extractor's decoder makes of the photos, and the worker (its model)."""
    spec = parse_spec(spec_raw)
    worker = Worker(spec)
    pixels = torch.stack([worker.decode(str(p)) for p in _files(Path(spec.data.root))])
    return pixels, worker


def _levels(pixel_values: torch.Tensor, mean, std) -> torch.Tensor:
    """A library's normalised pixels back in levels 0..255."""
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    return (pixel_values * s + m) * 255


def _hf_folder(tmp_path: Path, model, processor) -> Path:
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _hf_case(kind: str):
    t = transformers
    if kind == "clip":
        cfg = t.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                 image_size=32, patch_size=8)
        proc = t.CLIPImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32})
        return t.CLIPVisionModel(cfg), proc, "encoder.layers.*", 1
    if kind == "siglip":
        cfg = t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                   image_size=32, patch_size=8)
        proc = t.SiglipImageProcessor(size={"height": 32, "width": 32})  # squash, no crop
        return t.SiglipVisionModel(cfg), proc, "encoder.layers.*", 0
    cfg = t.Dinov2WithRegistersConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                      image_size=32, patch_size=8, num_register_tokens=4)
    proc = t.BitImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32},
                               image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    return t.Dinov2WithRegistersModel(cfg), proc, "encoder.layer.*", 5


@pytest.mark.parametrize("kind", ["clip", "siglip", "dinov2"])
def test_hugging_face_residual_stream_equals_output_hidden_states(kind: str, photos: Path, tmp_path: Path):
    torch.manual_seed(0)
    model, proc, blocks, prefix = _hf_case(kind)
    folder = _hf_folder(tmp_path, model.eval(), proc)
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu"},
              data={"resize": "auto", "crop": "auto", "shard_size": 4, "batch_size": 3},
              capture=[{"layer": blocks, "reduce": "none", "key": "{layer}.tokens"},
                       {"layer": blocks, "reduce": "mean", "drop_prefix": True, "key": "{layer}.patches"},
                       *([{"layer": blocks, "reduce": "cls", "key": "{layer}.cls"}] if prefix else [])])
    # pixels: equal to the library's PIL image processor, within 2 levels of its default torchvision one
    ours, worker = _our_pixels(raw)
    images = [__import__("PIL.Image").Image.open(p).convert("RGB") for p in _files(photos)]
    pil = getattr(transformers, type(proc).__name__ + "Pil").from_pretrained(folder)
    ref = _levels(pil(images, return_tensors="pt").pixel_values, proc.image_mean, proc.image_std)
    assert ours.shape == ref.shape == (len(SIZES), 3, 32, 32)
    assert (ours.float() - ref).abs().max() < 0.01  # the same pixels (float rounding only)
    fast = _levels(proc(images, return_tensors="pt").pixel_values, proc.image_mean, proc.image_std)
    diff = (ours.float() - fast).abs()
    assert diff.max() <= 2.01 and diff.mean() < 0.05, (diff.max(), diff.mean())
    assert worker.model_info["prefix_tokens"] == prefix
    worker.close()

    summary = run(parse_spec(raw))
    assert summary.ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["preprocess"]["crop_offset"] == "floor" and "hf:" in s.attrs["preprocess"]["source"]
    assert s.attrs["model"]["preprocess_defaults"]["crop_offset"] == "floor"  # what the library prescribes
    assert "pretrained" in s.attrs["model"]["weights"] and "random init" not in s.attrs["model"]["weights"]
    pixel_values = pil(images, return_tensors="pt").pixel_values
    with torch.no_grad():
        hidden = model(pixel_values=pixel_values, output_hidden_states=True).hidden_states
    layers = sorted(k.removesuffix(".tokens") for k in s.captures if k.endswith(".tokens"))
    assert len(layers) == 3
    for i, layer in enumerate(layers):
        h = hidden[i + 1].numpy()
        np.testing.assert_allclose(s.numpy(f"{layer}.tokens"), h, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(s.numpy(f"{layer}.patches"), h[:, prefix:].mean(1), atol=2e-4, rtol=1e-4)
        if prefix:
            np.testing.assert_allclose(s.numpy(f"{layer}.cls"), h[:, 0], atol=2e-4, rtol=1e-4)


def test_hugging_face_clip_model_gives_its_vision_tower_with_the_projection(photos: Path, tmp_path: Path):
    """A whole CLIPModel folder: the vision tower runs; its output's image_embeds is get_image_features."""
    t = transformers
    torch.manual_seed(0)
    cfg = t.CLIPConfig(vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                      "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
                       text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "vocab_size": 99}, projection_dim=16)
    clip = t.CLIPModel(cfg).eval()
    proc = t.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    folder = _hf_folder(tmp_path, clip, proc)
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu"},
              data={"resize": "auto", "crop": "auto"},
              capture=[{"layer": "(model)", "index": "image_embeds", "key": "embedding"}])
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["model"]["class"].endswith("CLIPVisionModelWithProjection")
    images = [__import__("PIL.Image").Image.open(p).convert("RGB") for p in _files(photos)]
    pixel_values = t.CLIPImageProcessorPil.from_pretrained(folder)(images, return_tensors="pt").pixel_values
    with torch.no_grad():
        ref = clip.get_image_features(pixel_values=pixel_values)
    ref = getattr(ref, "pooler_output", ref)
    np.testing.assert_allclose(s.numpy("embedding"), ref.numpy(), atol=2e-5, rtol=1e-4)


def test_timm_vit_blocks_equal_forward_intermediates_and_pixels_equal_timm_transform(photos: Path, tmp_path: Path):
    from PIL import Image

    raw = job(photos, tmp_path / "s.zarr",
              model={"name": "timm:vit_small_patch16_224", "device": "cpu",
                     "kwargs": {"img_size": 32, "depth": 3, "embed_dim": 48, "num_heads": 2}},
              data={"resize": "auto", "crop": "auto", "shard_size": 4, "batch_size": 3},
              capture=[{"layer": "blocks.*", "reduce": "none", "key": "{layer}"},
                       {"layer": "blocks.*", "reduce": "mean", "drop_prefix": True, "key": "{layer}.patches"}])
    ours, worker = _our_pixels(raw)
    model = worker.model
    cfg = timm.data.resolve_data_config({"input_size": (3, 32, 32)}, model=model)
    transform = timm.data.create_transform(**cfg)
    ref = torch.stack([transform(Image.open(p).convert("RGB")) for p in _files(photos)])
    assert cfg["crop_pct"] == 0.9 and cfg["interpolation"] == "bicubic"
    assert (ours.float() - _levels(ref, cfg["mean"], cfg["std"])).abs().max() < 0.01
    assert worker.model_info["prefix_tokens"] == 1
    worker.close()

    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    with torch.no_grad():
        inter = model.forward_intermediates(ref, indices=3, output_fmt="NLC", intermediates_only=True, norm=False)
    assert s.attrs["preprocess"]["resize"] == 35 and s.attrs["preprocess"]["crop"] == [32, 32]  # floor(32 / 0.9)
    for i, want in enumerate(inter):  # forward_intermediates gives patch tokens (prefix tokens left out)
        got = s.numpy(f"blocks.{i}")
        np.testing.assert_allclose(got[:, 1:], want.numpy(), atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(s.numpy(f"blocks.{i}.patches"), want.numpy().mean(1), atol=2e-5, rtol=1e-4)


def test_timm_resnet_stages_equal_forward_intermediates(photos: Path, tmp_path: Path):
    raw = job(photos, tmp_path / "s.zarr", model={"name": "timm:resnet10t", "device": "cpu"},
              data={"resize": "auto", "crop": 64},
              capture=[{"layer": "layer*", "reduce": "mean"}, {"layer": "layer2", "reduce": "none", "key": "map"}])
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    torch.manual_seed(0)
    model = timm.create_model("resnet10t").eval()
    pct = timm.data.resolve_model_data_config(model)["crop_pct"]  # at the crop asked for, in timm's proportion
    assert s.attrs["preprocess"]["resize"] == int(64 / pct) and s.attrs["preprocess"]["crop_pct"] == pct
    pixels = torch.stack([Worker(parse_spec(raw)).decode(str(p)) for p in _files(photos)])
    p = s.attrs["preprocess"]
    x = (pixels.float() / 255 - torch.tensor(p["mean"]).view(1, 3, 1, 1)) / torch.tensor(p["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        inter = model.forward_intermediates(x, indices=[1, 2, 3, 4], intermediates_only=True)
    for i, want in enumerate(inter):
        np.testing.assert_allclose(s.numpy(f"layer{i + 1}"), want.mean((2, 3)).numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s.numpy("map"), inter[1].numpy(), atol=2e-5, rtol=1e-4)


def test_open_clip_encode_image_is_the_root_output(photos: Path, tmp_path: Path):
    from PIL import Image

    raw = job(photos, tmp_path / "s.zarr",
              model={"name": "open_clip:ViT-S-32", "device": "cpu", "kwargs": {"force_image_size": 64}},
              data={"resize": "auto", "crop": "auto"},
              capture=[{"layer": "(model)", "key": "embedding"},
                       {"layer": "transformer.resblocks.1", "reduce": "cls", "key": "cls1"}])
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms("ViT-S-32", force_image_size=64)
    model.eval()
    x = torch.stack([preprocess(Image.open(p)) for p in _files(photos)])
    with torch.no_grad():
        ref = model.encode_image(x)
    np.testing.assert_allclose(s.numpy("embedding"), ref.numpy(), atol=2e-5, rtol=1e-4)
    assert s["cls1"].shape == (len(SIZES), 384)


def test_model_call_input_and_forward_kwargs_keep_the_layer_names(photos: Path, tmp_path: Path):
    """A whole open_clip CLIP via a factory: model.call encode_image with a keyword; layer names are the model's."""
    raw = job(photos, tmp_path / "s.zarr",
              model={"name": None, "factory": "open_clip:create_model", "device": "cpu",
                     "kwargs": {"model_name": "ViT-S-32", "force_image_size": 64},
                     "call": "encode_image", "input": "image", "forward_kwargs": {"normalize": True}},
              data={"resize": 64, "crop": 64, "preprocess": "imagenet"},
              capture=[{"layer": "(model)", "key": "embedding"}, {"layer": "visual.ln_post", "key": "post"}])
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    np.testing.assert_allclose(np.linalg.norm(s.numpy("embedding"), axis=1), 1.0, atol=1e-5)  # normalize: true
    assert s.attrs["model"]["weights"] == "factory open_clip:create_model (weights as the factory built them)"


def test_unknown_names_missing_weights_and_bad_kwargs_are_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from extractor.model.build import build_model
    from extractor.spec.model_spec import ModelSpec

    monkeypatch.delenv("EXTRACTOR_ALLOW_DOWNLOAD", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(ModelError, match=r"not a timm model; closest: vit_small_patch16_224"):
        build_model(ModelSpec(name="timm:vit_smal_patch16_224"))
    with pytest.raises(ModelError, match=r"not a open_clip model; closest: ViT-B-32"):
        build_model(ModelSpec(name="open_clip:ViT-B-3"))
    with pytest.raises(ModelError, match=r"not in the local cache .*downloads are off.*EXTRACTOR_ALLOW_DOWNLOAD=1"):
        build_model(ModelSpec(name="hf:no-such-org/no-such-model", weights="pretrained"))
    with pytest.raises(ModelError, match=r"not in the local cache .*timm.create_model\('resnet10t', pretrained=True\)"):
        build_model(ModelSpec(name="timm:resnet10t", weights="pretrained"))
    with pytest.raises(ModelError, match=r"not a pretrained tag of open_clip:ViT-S-32"):
        build_model(ModelSpec(name="open_clip:ViT-S-32", weights="laion9000"))
    with pytest.raises(ModelError, match=r"builder refused model.kwargs"):
        build_model(ModelSpec(name="resnet18", weights=None, kwargs={"no_such_flag": 1}))


def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch):
    import sys

    from extractor.model.build import build_model
    from extractor.spec.model_spec import ModelSpec

    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed
    with pytest.raises(ModelError, match=r"needs timm, which is not installed .*extractor\[models\]"):
        build_model(ModelSpec(name="timm:resnet10t"))


def test_inception_from_a_torchvision_state_dict_keeps_its_input_transform(tmp_path: Path):
    """torchvision's pretrained inception_v3 transforms its input; the same state dict from a file does too."""
    from torchvision.models import inception_v3

    from extractor.model.build import build_model
    from extractor.spec.model_spec import ModelSpec

    torch.manual_seed(1)
    ref = inception_v3(weights=None, transform_input=True, aux_logits=True, init_weights=False).eval()
    torch.save(ref.state_dict(), tmp_path / "inc.pt")
    model, _ = build_model(ModelSpec(name="inception_v3", weights=str(tmp_path / "inc.pt")))
    assert model.transform_input
    x = torch.randn(1, 3, 299, 299)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


def test_attention_probabilities_are_named_as_such_and_equal_output_attentions(photos: Path, tmp_path: Path):
    """model.forward_kwargs output_attentions: the attention module's second output is
    (batch, head, query, key): decided from its rows summing to 1, named so, equal to the model's own."""
    t = transformers
    torch.manual_seed(0)
    model, proc, _, _ = _hf_case("clip")
    model.config._attn_implementation = "eager"
    folder = _hf_folder(tmp_path, model.eval(), proc)
    raw = job(photos, tmp_path / "s.zarr",
              model={"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu",
                     "kwargs": {"_attn_implementation": "eager"}, "forward_kwargs": {"output_attentions": True}},
              data={"resize": "auto", "crop": "auto"},
              capture=[{"layer": "encoder.layers.1.self_attn", "index": 1, "key": "attn"}])
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.captures["attn"]["dims"] == ["attn.head", "attn.query", "attn.key"] and s["attn"].shape[1:] == (2, 17, 17)
    images = [__import__("PIL.Image").Image.open(p).convert("RGB") for p in _files(photos)]
    pixel_values = t.CLIPImageProcessorPil.from_pretrained(folder)(images, return_tensors="pt").pixel_values
    with torch.no_grad():
        ref = model(pixel_values=pixel_values, output_attentions=True).attentions[1]
    np.testing.assert_allclose(s.numpy("attn"), ref.numpy(), atol=1e-5, rtol=1e-4)
    raw["capture"][0]["reduce"] = "mean"
    raw["output"]["if_exists"] = "overwrite"
    with pytest.raises(Exception, match=r"attention probabilities .* reduce: mean over them is not defined"):
        run(parse_spec(raw))


def test_drop_prefix_on_a_map_is_refused_as_not_a_token_sequence(image_dir: Path, tmp_path: Path):
    """Before: it asked for model.prefix_tokens, which cannot help a CNN's map."""
    from extractor.errors import LayerError

    raw = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer3", "reduce": "mean", "drop_prefix": True}])
    with pytest.raises(LayerError, match=r"capture\[0\] layer3: layer 'layer3' gives \(32, 4, 4\) per image, not a "
                                         r"token sequence \(tokens, features\): drop_prefix keeps patch tokens"):
        run(parse_spec(raw))


def test_open_clip_takes_a_checkpoint_of_its_visual_tower_or_of_the_whole_clip(tmp_path: Path):
    from extractor.model.build import build_model, state_dict_hash
    from extractor.spec.model_spec import ModelSpec

    torch.manual_seed(7)
    clip = open_clip.create_model("ViT-S-32", force_image_size=64)
    torch.save(clip.visual.state_dict(), tmp_path / "visual.pt")
    torch.save(clip.state_dict(), tmp_path / "whole.pt")
    for name in ("visual.pt", "whole.pt"):
        _model, info = build_model(ModelSpec(name="open_clip:ViT-S-32", weights=str(tmp_path / name),
                                            kwargs={"force_image_size": 64}))
        assert info["state_dict_sha256"] == state_dict_hash(clip.visual), name
        assert f"weights from checkpoint {tmp_path / name}" in info["weights"]
    torch.save({"nope": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ModelError, match=r"does not fit the model.*neither open_clip:ViT-S-32's whole CLIP nor its "
                                         r"visual tower"):
        build_model(ModelSpec(name="open_clip:ViT-S-32", weights=str(tmp_path / "other.pt"),
                              kwargs={"force_image_size": 64}))


def test_an_hf_folder_without_a_processor_config_asks_naming_its_image_size(photos: Path, tmp_path: Path):
    from extractor.errors import SpecError

    torch.manual_seed(0)
    model, _, _, _ = _hf_case("clip")
    model.save_pretrained(tmp_path / "hf")  # no preprocessor_config.json
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{tmp_path / 'hf'}", "device": "cpu"},
              data={"resize": "auto", "crop": "auto"}, capture=[{"layer": "(model)", "index": "pooler_output"}])
    with pytest.raises(SpecError, match=r"no image processor config .*its config says image_size 32 \(e.g. crop: 32\)"):
        run(parse_spec(raw))
    raw["data"] = {**raw["data"], "resize": 32, "crop": 32, "preprocess": "imagenet"}
    s = run(parse_spec(raw))
    assert s.ok == len(SIZES)


def test_a_layout_the_module_type_contradicts_is_obeyed_with_a_warning(image_dir: Path, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture):
    raw = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "conv1", "reduce": "mean", "layout": "nhwc"}])
    with caplog.at_level("WARNING", logger="extractor.compute.worker"):
        assert run(parse_spec(raw)).ok == 12
    assert "capture[0] conv1: layout nhwc is given, but layer 'conv1' (Conv2d) gives nchw outputs" in caplog.text


def _deit_folder(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A small random Hugging Face DeiT (CLS and distillation tokens) saved with save_pretrained."""
    torch.manual_seed(0)
    model = transformers.DeiTModel(transformers.DeiTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                           intermediate_size=64, image_size=32, patch_size=8)).eval()
    model.save_pretrained(tmp_path / "deit")
    return tmp_path / "deit", model


TIMM_SMALL = {"img_size": 32, "depth": 2, "embed_dim": 48, "num_heads": 2}
PREFIX_CASES = {  # model section, input size, prefix tokens (CLS, distillation, registers)
    "hf DeiT": (None, 32, 2),
    "timm DeiT distilled": ({"name": "timm:deit_tiny_distilled_patch16_224", "kwargs": TIMM_SMALL}, 32, 2),
    "timm DINOv2 4 registers": ({"name": "timm:vit_small_patch14_reg4_dinov2", "kwargs": {**TIMM_SMALL,
                                                                                         "img_size": 28}}, 28, 5),
    "open_clip ViT": ({"name": "open_clip:ViT-S-32", "kwargs": {"force_image_size": 64}}, 64, 1),
    "timm ViT without class token": ({"name": "timm:vit_small_patch16_224",
                                      "kwargs": {**TIMM_SMALL, "class_token": False, "global_pool": "avg"}}, 32, 0),
    "torchvision ViT": ({"name": "vit_b_16", "kwargs": {"image_size": 32}}, 32, 1),
    "a CNN (no token sequence)": ({"name": "resnet18"}, 32, None),
}


@pytest.mark.parametrize("case", PREFIX_CASES, ids=list(PREFIX_CASES))
def test_prefix_tokens_are_the_sequence_length_less_the_patch_grid(case: str, photos: Path, tmp_path: Path):
    """Decided from facts: the token sequences' length against the patch embedding's grid at the input size
    (and timm's num_prefix_tokens where it has one); the distillation token counts."""
    model, size, want = PREFIX_CASES[case]
    if model is None:
        model = {"name": f"hf:{_deit_folder(tmp_path)[0]}", "weights": "pretrained"}
    raw = job(photos, tmp_path / "s.zarr", model={"weights": None, **model, "device": "cpu"},
              data={"resize": size, "crop": size, "preprocess": "imagenet"}, capture=[{"layer": "(model)"}])
    worker = Worker(parse_spec(raw))
    assert worker.model_info["prefix_tokens"] == want
    worker.close()


def test_drop_prefix_of_hf_deit_leaves_out_cls_and_distillation_tokens(photos: Path, tmp_path: Path):
    """Before: a list of attribute names found only the CLS token, and the patch mean kept the distillation
    token (6% off). Compared with output_hidden_states on the same pixels."""
    folder, model = _deit_folder(tmp_path)
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu"},
              data={"resize": 32, "crop": 32, "preprocess": "imagenet"},
              capture=[{"layer": "layers.*", "reduce": "mean", "drop_prefix": True, "key": "{layer}.patches"},
                       {"layer": "layers.1", "drop_prefix": True, "key": "patches"}])
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.model["prefix_tokens"] == 2 and s.captures["patches"]["drop_prefix"] == 2
    pixels, worker = _our_pixels(raw)
    x = (pixels.float() / 255 - worker.mean) / worker.std
    worker.close()
    with torch.no_grad():
        hidden = model(pixel_values=x, output_hidden_states=True).hidden_states
    for i in range(2):
        np.testing.assert_allclose(s.numpy(f"layers.{i}.patches"), hidden[i + 1][:, 2:].mean(1).numpy(),
                                   atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s.numpy("patches"), hidden[2][:, 2:].numpy(), atol=2e-5, rtol=1e-4)
    assert s.token_span("patches", True) == (0, 16)  # the reader drops nothing more


def test_drop_prefix_of_a_layer_of_patches_only_keeps_them_all(photos: Path, tmp_path: Path):
    """The patch embedding's 16 tokens: every one a patch (issue 54: decided per layer). Before: refused, as not
    the model's sequence of 16 patches + 2."""
    folder, model = _deit_folder(tmp_path)
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{folder}", "weights": "pretrained", "device": "cpu"},
              data={"resize": 32, "crop": 32, "preprocess": "imagenet"},
              capture=[{"layer": "embeddings.patch_embeddings", "drop_prefix": True, "reduce": "mean", "key": "p"}])
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    pixels, worker = _our_pixels(raw)
    x = (pixels.float() / 255 - worker.mean) / worker.std
    worker.close()
    with torch.no_grad():
        want = model.embeddings.patch_embeddings(x).mean(1).numpy()
    np.testing.assert_allclose(s.numpy("p"), want, atol=2e-5, rtol=1e-4)
    assert s.captures["p"]["tokens"] == {"before": 0, "patches": 16, "after": 0, "grid": [4, 4]}


def test_a_forward_that_draws_at_random_is_refused_and_the_readme_way_out_works(photos: Path, tmp_path: Path):
    """HF ViTMAE masks and shuffles patches at random in eval mode: refused before a store exists, naming
    the capture; the models guide's module (no masking, ordered noise) stores what a direct call computes."""
    import re

    import extractor

    torch.manual_seed(0)
    cfg = transformers.ViTMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8)
    transformers.ViTMAEModel(cfg).save_pretrained(tmp_path / "mae")
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{tmp_path / 'mae'}", "weights": "pretrained",
                                                   "device": "cpu"},
              data={"resize": 32, "crop": 32, "preprocess": "imagenet"},
              capture=[{"layer": "layers.1", "key": "tokens"}])
    with pytest.raises(ModelError, match=r"not deterministic in eval mode: two forwards of the same image differ in "
                                         r"tokens by up to .*'A forward that draws at random'"):
        run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()

    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "models.md").read_text()
    section = text[text.index("## A forward that draws at random"):]
    namespace: dict = {}
    exec(compile(re.findall(r"```python\n(.*?)```", section, re.S)[0], "models.md", "exec"), namespace)
    module = namespace["UnmaskedViTMAE"](str(tmp_path / "mae")).eval()
    spec = {k: v for k, v in raw.items() if k != "model"}
    spec["capture"] = [{"layer": "mae.layers.1", "key": "tokens"}, {"layer": "(model)", "key": "out"}]
    store = extractor.run({**spec, "model": {"device": "cpu"}}, model=module, progress=False)
    pixels, worker = _our_pixels({**raw, "model": {"name": "resnet18", "weights": None, "device": "cpu"},
                                  "capture": [{"layer": "(model)"}]})
    worker.close()
    x = (pixels.float() / 255 - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / \
        torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        want = module(x).numpy()
    assert store["out"].shape == (len(SIZES), 17, 32)
    np.testing.assert_allclose(store.numpy("out"), want, atol=2e-5, rtol=1e-4)


def test_an_hf_folder_loads_its_own_weights_unless_random_is_asked(photos: Path, tmp_path: Path):
    """weights left out (auto): the folder's model.safetensors (before: a random init from its config, so two
    folders gave identical stores); random init only when asked, and recorded so."""
    from extractor.spec.model_spec import ModelSpec

    stores = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model, proc, _, _ = _hf_case("clip")
        folder = _hf_folder(tmp_path / f"m{seed}", model.eval(), proc)
        raw = job(photos, tmp_path / f"s{seed}.zarr", model={"name": f"hf:{folder}", "device": "cpu"},
                  data={"resize": "auto", "crop": "auto"}, capture=[{"layer": "(model)", "index": "pooler_output"}])
        del raw["model"]["weights"]
        assert run(parse_spec(raw)).ok == len(SIZES)
        stores[seed] = s = open_store(str(tmp_path / f"s{seed}.zarr"))
        assert "pretrained" in s.model["weights"] and "random" not in s.model["weights"]
        pil = transformers.CLIPImageProcessorPil.from_pretrained(folder)
        images = [__import__("PIL.Image").Image.open(p).convert("RGB") for p in _files(photos)]
        with torch.no_grad():
            want = model(pixel_values=pil(images, return_tensors="pt").pixel_values).pooler_output
        np.testing.assert_allclose(s.numpy("output"), want.numpy(), atol=2e-5, rtol=1e-4)
    assert not np.allclose(stores[0].numpy("output"), stores[1].numpy("output"))
    from extractor.model.build import build_model

    _, info = build_model(ModelSpec(name=f"hf:{tmp_path / 'm0' / 'hf'}", weights="random"))
    assert info["weights"].endswith("random init (seed 0)")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "m0" / "hf" / "config.json").read_text())
    with pytest.raises(ModelError, match=r"the folder holds no weights .*set model.weights: random"):
        build_model(ModelSpec(name=f"hf:{tmp_path / 'bare'}"))
    assert "random init" in build_model(ModelSpec(name=f"hf:{tmp_path / 'bare'}", weights=None))[1]["weights"]


def test_a_bare_architecture_name_asks_for_its_weights():
    from extractor.model.build import build_model
    from extractor.spec.model_spec import ModelSpec

    with pytest.raises(ModelError, match=r"'resnet18' names an architecture, not its weights: set model.weights to "
                                         r"pretrained \(torchvision's DEFAULT\)"):
        build_model(ModelSpec(name="resnet18"))
    with pytest.raises(ModelError, match=r"names an architecture.*timm:resnet10t.TAG"):
        build_model(ModelSpec(name="timm:resnet10t"))
    with pytest.raises(ModelError, match=r"auto is ambiguous for open_clip:ViT-S-32; name a tag"):
        build_model(ModelSpec(name="open_clip:ViT-S-32"))
    for random in ("random", None):
        assert "random init (seed 0)" in build_model(ModelSpec(name="resnet18", weights=random))[1]["weights"]


def test_an_hf_image_classification_folder_keeps_its_head(photos: Path, tmp_path: Path):
    """The class its config names (architectures), so .logits feed a gradient job; before, the bare backbone
    was built and the head's weights dropped without a word."""
    t = transformers
    torch.manual_seed(0)
    cfg = t.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                      patch_size=8, num_labels=3)
    model = t.ViTForImageClassification(cfg).eval()
    model.save_pretrained(tmp_path / "vit")
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{tmp_path / 'vit'}", "device": "cpu"},
              data={"resize": 32, "crop": 32, "preprocess": "imagenet"},
              capture=[{"layer": "(model)", "index": "logits", "key": "logits"},
                       {"layer": "vit.layernorm", "what": "grad_output", "key": "grad"}])
    del raw["model"]["weights"]
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.model["class"].endswith("ViTForImageClassification")
    pixels, worker = _our_pixels({**raw, "capture": [{"layer": "(model)", "index": "logits"}]})
    x = (pixels.float() / 255 - worker.mean) / worker.std
    worker.close()
    with torch.no_grad():
        logits = model(pixel_values=x).logits
    np.testing.assert_allclose(s.numpy("logits"), logits.numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(s.numpy("target"), logits.argmax(1).numpy())
    x.requires_grad_(True)
    hidden = {}
    handle = model.vit.layernorm.register_forward_hook(lambda m, a, out: hidden.setdefault("h", out))
    out = model(pixel_values=x).logits
    handle.remove()
    score = out.gather(1, out.argmax(1, keepdim=True)).sum()
    (grad,) = torch.autograd.grad(score, hidden["h"])
    np.testing.assert_allclose(s.numpy("grad"), grad.numpy(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("edge", [32, 384])
def test_hf_convnext_processor_crop_pct_rule_is_reproduced(edge: int, photos: Path, tmp_path: Path):
    """ConvNeXt's processors: below 384 the shorter side to shortest_edge / crop_pct and a centre crop; at 384
    a squash. Pixels equal its PIL processor's (before: refused with settings the spec never set)."""
    t = transformers
    torch.manual_seed(0)
    cfg = t.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=edge)
    proc = t.ConvNextImageProcessorPil(size={"shortest_edge": edge}, crop_pct=0.875)
    folder = _hf_folder(tmp_path, t.ConvNextModel(cfg).eval(), proc)
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{folder}", "device": "cpu"},
              data={"resize": "auto", "crop": "auto"}, capture=[{"layer": "(model)", "index": "pooler_output"}])
    ours, worker = _our_pixels(raw)
    worker.close()
    images = [__import__("PIL.Image").Image.open(p).convert("RGB") for p in _files(photos)]
    ref = _levels(proc(images, return_tensors="pt").pixel_values, proc.image_mean, proc.image_std)
    assert ours.shape == ref.shape == (len(SIZES), 3, edge, edge)
    assert (ours.float() - ref).abs().max() < 0.01
    assert worker.preprocess.crop == ((edge, edge) if edge < 384 else None)


def test_a_variable_resolution_processor_is_refused_as_such(photos: Path, tmp_path: Path):
    from extractor.errors import SpecError

    t = transformers
    cfg = t.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                patch_size=8, num_patches=16)
    folder = _hf_folder(tmp_path, t.Siglip2VisionModel(cfg), t.Siglip2ImageProcessor(patch_size=8, max_num_patches=16))
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{folder}", "device": "cpu"},
              data={"resize": "auto", "crop": "auto"}, capture=[{"layer": "(model)", "index": "pooler_output"}])
    with pytest.raises(SpecError, match=r"resizes each image to its own size \(variable resolution, max_num_patches\)"
                                        r": extractor .* does not support variable-resolution processors"):
        Worker(parse_spec(raw))


def test_a_module_object_gets_its_own_librarys_preprocessing_or_is_refused(photos: Path, tmp_path: Path):
    """extractor.run(job, model=...) with no data.* settings: an HF model's processor (name_or_path), timm's
    pretrained_cfg, open_clip's preprocess_cfg; a module that carries none is refused naming the settings
    (before: ImageNet 256/224 after one log line, 0.74 off for a SigLIP tower)."""
    import extractor
    from extractor.errors import SpecError

    torch.manual_seed(0)
    model, proc, _, _ = _hf_case("siglip")
    folder = _hf_folder(tmp_path, model.eval(), proc)
    raw = job(photos, tmp_path / "a.zarr", data={"resize": "auto", "crop": "auto"},
              capture=[{"layer": "(model)", "index": "pooler_output", "key": "emb"}])
    del raw["model"]
    del raw["data"]["preprocess"]  # what job() sets for its default toy model, not for a module given
    loaded = transformers.SiglipVisionModel.from_pretrained(folder).eval()
    a = extractor.run(raw, model=loaded, progress=False)
    raw_b = job(photos, tmp_path / "b.zarr", model={"name": f"hf:{folder}", "device": "cpu"},
                data={"resize": "auto", "crop": "auto"},
                capture=[{"layer": "(model)", "index": "pooler_output", "key": "emb"}])
    del raw_b["model"]["weights"]
    b = extractor.run(raw_b, progress=False)
    assert a.attrs["preprocess"] == b.attrs["preprocess"] and a.attrs["preprocess"]["resize"] == [32, 32]
    np.testing.assert_allclose(a.numpy("emb"), b.numpy("emb"), atol=1e-6)

    vit = timm.create_model("vit_small_patch16_224", img_size=32, depth=1, embed_dim=48, num_heads=2).eval()
    raw["output"]["store"] = str(tmp_path / "c.zarr")
    raw["capture"] = [{"layer": "(model)", "key": "emb"}]
    c = extractor.run(raw, model=vit, progress=False)
    assert "timm data config" in c.attrs["preprocess"]["source"] and c.attrs["preprocess"]["crop"] == [32, 32]
    clip = open_clip.create_model("ViT-S-32", force_image_size=64).eval()
    raw["output"]["store"] = str(tmp_path / "d.zarr")
    d = extractor.run({**raw, "model": {"call": "encode_image"}}, model=clip, progress=False)
    assert "open_clip transform" in d.attrs["preprocess"]["source"] and d.attrs["preprocess"]["crop"] == [64, 64]

    raw["output"]["store"] = str(tmp_path / "e.zarr")
    plain = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with pytest.raises(SpecError, match=r"carries no preprocessing extractor knows .*data.resize, data.crop, "
                                        r"data.interpolation, data.mean, data.std cannot be 'auto'.*data.preprocess: "
                                        r"imagenet"):
        extractor.run(raw, model=plain, progress=False)
    assert not (tmp_path / "e.zarr").exists()


@pytest.mark.parametrize("kind", ["owlv2", "blip"])
def test_a_composite_folder_whose_tower_has_no_auto_class_builds_the_tower_its_config_names(kind: str, tmp_path: Path):
    """OWLv2's and BLIP's vision towers have no AutoModel class (before: a KeyError traceback in _hf_class); BLIP's
    holds its modules at the root, so its weights come from the checkpoint's vision_model."""
    from extractor.model.sources import build
    from extractor.spec.load import parse_model_spec

    t = transformers
    torch.manual_seed(0)
    v = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "image_size": 32, "patch_size": 8}
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 99, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
    whole = (t.Owlv2ForObjectDetection(t.Owlv2Config(vision_config=v, text_config=text)) if kind == "owlv2" else
             t.BlipModel(t.BlipConfig(vision_config=v, text_config={**text, "sep_token_id": 2}))).eval()
    whole.save_pretrained(tmp_path / kind)
    built = build(parse_model_spec({"name": f"hf:{tmp_path / kind}", "weights": "pretrained"}, "test"))
    assert type(built.model).__name__ == ("Owlv2VisionModel" if kind == "owlv2" else "BlipVisionModel")
    tower = whole.owlv2.vision_model if kind == "owlv2" else whole.vision_model
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        np.testing.assert_allclose(built.model(pixel_values=x).pooler_output.numpy(),
                                   tower(pixel_values=x).pooler_output.numpy(), atol=1e-6)


def test_a_vision_tower_with_no_class_of_its_own_is_refused_naming_the_factory():
    from extractor.model.sources.hf import _hf_tower_class

    class NoSuchVisionConfig:  # a tower config transformers has no model class for (Idefics2's, say)
        pass

    with pytest.raises(ModelError, match=r"^hf:somewhere: its vision tower \(NoSuchVisionConfig\) has no model class "
                                         r"transformers builds on its own; build the tower in a function named by "
                                         r"model.factory"):
        _hf_tower_class(transformers, NoSuchVisionConfig(), "somewhere")


def test_an_hf_pooler_output_of_one_position_is_stored_channels_first(photos: Path, tmp_path: Path):
    """issue 54: HF ResNet's pooler_output, C x 1 x 1 at every input size, was refused as "the model does not run
    at another input size" (it does: no dim grows). Its channels come first; the values are the model's."""
    t = transformers
    torch.manual_seed(0)
    cfg = t.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    model = t.ResNetModel(cfg).eval()
    model.save_pretrained(tmp_path / "resnet")
    raw = job(photos, tmp_path / "s.zarr", model={"name": f"hf:{tmp_path / 'resnet'}", "device": "cpu"},
              data={"resize": 48, "crop": 40, "preprocess": "imagenet"},
              capture=[{"layer": "(model)", "index": "pooler_output", "reduce": "none", "key": "pooled"},
                       {"layer": "(model)", "index": "pooler_output", "reduce": "mean", "key": "mean"}])
    del raw["model"]["weights"]
    assert run(parse_spec(raw)).ok == len(SIZES)
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.captures["pooled"]["dims"] == ["pooled.channel", "pooled.y", "pooled.x"] and s["pooled"].shape[1:] == \
        (16, 1, 1)
    pixels, worker = _our_pixels({**raw, "capture": raw["capture"][:1]})
    worker.close()
    with torch.no_grad():
        want = model(pixel_values=(pixels.float() / 255 - worker.mean) / worker.std).pooler_output
    np.testing.assert_allclose(s.numpy("pooled"), want.numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s.numpy("mean"), want.numpy()[:, :, 0, 0], atol=2e-5, rtol=1e-4)


def test_an_hf_processor_of_a_size_per_image_or_of_a_size_extractor_cannot_make_says_which(photos: Path,
                                                                                          tmp_path: Path):
    """issue 54: a processor whose output size varies per image (DETR's shortest and longest edge) was refused as
    "resizes to SizeDict(height=None, width=None, ...)"; one of one size that extractor's settings cannot make
    (SAM's longest edge, padded) now names its size and data.preprocess: library, which runs it."""
    from extractor.errors import SpecError

    t = transformers
    torch.manual_seed(0)
    vit = t.ViTModel(t.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8)).eval()
    cases = {"detr": t.DetrImageProcessor(size={"shortest_edge": 32, "longest_edge": 64}),
             "sam": t.SamImageProcessor(size={"longest_edge": 32}, pad_size={"height": 32, "width": 32})}
    for name, proc in cases.items():
        folder = _hf_folder(tmp_path / name, vit, proc)

        def spec(preprocess: str, name: str = name, folder: Path = folder) -> dict:
            raw = job(photos, tmp_path / f"{name}-{preprocess}.zarr", model={"name": f"hf:{folder}", "device": "cpu"},
                      data={"resize": "auto", "crop": "auto", "preprocess": preprocess},
                      capture=[{"layer": "(model)", "index": "pooler_output"}])
            return parse_spec(raw)

        with pytest.raises(SpecError) as err:
            Worker(spec("auto"))
        said = str(err.value)
        assert "SizeDict" not in said, said
        if name == "detr":
            assert said.startswith(f"the image processor DetrImageProcessor of hf:{folder} resizes each image to its "
                                   "own size (variable resolution: probe images 13x19"), said
        else:
            assert said.startswith(f"the image processor of hf:{folder} resizes (longest_edge 32), which extractor "
                                   "does not reproduce") and "(data.preprocess: library runs that processor" in said
            worker = Worker(spec("library"))
            assert worker.preprocess.runs == "library" and worker.preprocess.size == (32, 32)
            worker.close()


def test_a_timm_crop_pct_above_one_pads_as_timm_does(photos: Path, tmp_path: Path):
    """issue 54: timm's crop_pct 1.15 (VOLO at 448) resizes below the crop and pads, as timm's own transform does;
    it was refused as "data.crop is larger than data.resize" though the job set neither. The pixels equal timm's."""
    from PIL import Image

    raw = job(photos, tmp_path / "s.zarr", data={"resize": "auto", "crop": "auto"},
              model={"name": "timm:resnet10t", "device": "cpu",
                     "kwargs": {"pretrained_cfg_overlay": {"crop_pct": 1.15, "input_size": [3, 64, 64]}}},
              capture=[{"layer": "layer1", "reduce": "mean"}])
    ours, worker = _our_pixels(raw)
    cfg = timm.data.resolve_model_data_config(worker.model)
    assert worker.preprocess.resize == 55 and worker.preprocess.crop == (64, 64)  # floor(64 / 1.15)
    assert "padded with black as timm's transform pads it" in worker.preprocess.source
    worker.close()
    transform = timm.data.create_transform(**cfg)
    ref = torch.stack([transform(Image.open(p).convert("RGB")) for p in _files(photos)])
    assert (ours.float() - _levels(ref, cfg["mean"], cfg["std"])).abs().max() < 0.01
    for img in ours:  # the shorter side, resized to 55, padded to 64: black rows or columns at its edge
        assert (img[:, :4] == 0).all() or (img[:, :, :4] == 0).all()


@pytest.mark.parametrize("how", ["timm in_chans", "timm pretrained_cfg", "hf num_channels"])
def test_a_model_of_one_channel_is_refused_naming_its_channels_not_the_input_size(photos: Path, tmp_path: Path,
                                                                                  how: str):
    """issue 54: a grayscale model (timm's in_chans 1) failed inside torch's conv, the message suggesting another
    input size. Refused naming the channels it takes and what to do, in the probe and in extractor layers."""
    from helpers.processes import cli

    if how == "hf num_channels":
        t = transformers
        t.ViTModel(t.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               image_size=32, patch_size=8, num_channels=1)).save_pretrained(tmp_path / "vit")
        model = {"name": f"hf:{tmp_path / 'vit'}", "device": "cpu", "weights": "random"}
        first = "embeddings.patch_embeddings.projection"
    else:
        kwargs = {"in_chans": 1} if how == "timm in_chans" else \
            {"pretrained_cfg_overlay": {"input_size": [1, 32, 32]}}
        model = {"name": "timm:resnet10t", "device": "cpu", "kwargs": kwargs}
        first = "conv1.0"
    raw = job(photos, tmp_path / "s.zarr", model=model, data={"resize": 32, "crop": 32, "preprocess": "imagenet"},
              capture=[{"layer": "(model)", "index": "pooler_output"} if how == "hf num_channels" else
                       {"layer": "layer1", "reduce": "mean"}])
    with pytest.raises(ModelError, match=rf"^the model takes 1-channel images \(its first convolution, {first}, has "
                                         r"in_channels 1\), and extractor feeds 3-channel RGB .*: build it for 3 "
                                         r"channels .*; it failed on a blank image"):
        run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()
    if how == "timm in_chans":
        r = cli("layers", "timm:resnet10t", "--kwargs", "{in_chans: 1}", "--input-size", "32")
        assert r.returncode == 1 and "error: the model takes 1-channel images (its first convolution" in r.stderr
