from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import toy_models
from PIL import Image

from extractor.driver.runner import run
from extractor.errors import LayerError
from extractor.model.capture import Capturer
from extractor.model.targets import resolve_targets
from extractor.read.reader import open_store
from extractor.spec.capture_spec import CaptureSpec
from extractor.spec.load import parse_spec


def caps(*items: dict) -> list[CaptureSpec]:
    return [CaptureSpec(**c) for c in items]


def test_tutorial_example_through_hooks_and_store(tmp_path: Path):
    """Conv2d(1, 2, 3) with kernels of 1s and 2s on a 4x4 all-ones input: maps of 9s and 18s, pooled 9 and 18."""
    (tmp_path / "img").mkdir()
    Image.new("RGB", (4, 4), (255, 255, 255)).save(tmp_path / "img" / "ones.png")
    spec = parse_spec({
        "model": {"name": None, "factory": "toy_models:tutorial_net", "device": "cpu", "channels_last": False},
        "data": {"root": str(tmp_path / "img"), "resize": None, "crop": 4, "mean": [0, 0, 0], "std": [1, 1, 1],
                 "shard_size": 1},
        "capture": [{"layer": "conv"}, {"layer": "pool"}, {"layer": "conv", "reduce": "max", "key": "conv_max"}],
        "output": {"store": str(tmp_path / "t.zarr"), "chunk_rows": 1},
        "cluster": {"backend": "local"},
    })
    run(spec)
    s = open_store(str(tmp_path / "t.zarr"))
    conv, pool = s.numpy("conv"), s.numpy("pool")
    assert conv.shape == (1, 2, 2, 2) and pool.shape == (1, 2, 1, 1)
    np.testing.assert_array_equal(conv[0, 0], np.full((2, 2), 9.0))
    np.testing.assert_array_equal(conv[0, 1], np.full((2, 2), 18.0))
    np.testing.assert_array_equal(pool[0, :, 0, 0], [9.0, 18.0])
    np.testing.assert_array_equal(s.numpy("conv_max")[0], [9.0, 18.0])


def test_tuple_and_dict_outputs():
    model = toy_models.tuple_net().eval()
    x = torch.randn(2, 3, 8, 8)
    targets = resolve_targets(model, caps(
        {"layer": "heads", "index": 0, "key": "h0"},
        {"layer": "heads", "index": 1, "key": "h1"},
        {"layer": "dict", "index": "min", "key": "dmin"},
    ))
    with Capturer(model, targets) as cap, torch.inference_mode():
        out = cap.run(x)
        y = model.conv(x)
    torch.testing.assert_close(out["h0"], y.mean(dim=(2, 3)))
    torch.testing.assert_close(out["h1"], y.amax(dim=(2, 3)))
    torch.testing.assert_close(out["dmin"], y.amin(dim=(2, 3)))


def test_tuple_output_without_index_is_a_clear_error():
    model = toy_models.tuple_net().eval()
    targets = resolve_targets(model, caps({"layer": "heads"}))
    with Capturer(model, targets) as cap, pytest.raises(LayerError, match=r"tuple of 2 .*set index"):
        cap.run(torch.randn(1, 3, 8, 8))
    targets = resolve_targets(model, caps({"layer": "dict", "index": "max"}))
    with Capturer(model, targets) as cap, pytest.raises(LayerError, match="no element 'max'"):
        cap.run(torch.randn(1, 3, 8, 8))


def test_inplace_relu_after_hooked_layer_does_not_change_capture():
    model = toy_models.inplace_net().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        expected = model.conv(x).clone()
    assert (expected < 0).any()  # the ReLU would change it if the capture were a view
    targets = resolve_targets(model, caps({"layer": "conv"}, {"layer": "relu", "what": "input", "key": "relu_in"},
                                          {"layer": "pool", "reduce": "flatten", "key": "pooled"}))
    with Capturer(model, targets) as cap, torch.inference_mode():
        out = cap.run(x)
    torch.testing.assert_close(out["conv"], expected)
    torch.testing.assert_close(out["relu_in"], expected)
    # and the model's own result is unchanged by the hooks
    with torch.inference_mode():
        torch.testing.assert_close(out["pooled"], model(x))


def test_no_hooks_left_after_a_forward_that_raised_and_mode_restored():
    model = toy_models.RaisingNet()
    model.train()
    targets = resolve_targets(model, caps({"layer": "conv"}, {"layer": "head"}))
    with pytest.raises(RuntimeError, match="boom"), Capturer(model, targets) as cap:  # noqa: PT012 - in the hooks' scope
        assert not model.training  # captures run in eval mode
        assert model.conv._forward_hooks and model.head._forward_hooks
        cap.run(torch.randn(1, 3, 8, 8))
    assert model.training
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_forward_stops_after_the_last_needed_layer():
    from torchvision.models import resnet18

    model = resnet18().eval()
    calls: list[str] = []
    for name in ("layer3", "layer4", "fc"):
        getattr(model, name).register_forward_pre_hook(lambda m, a, name=name: calls.append(name))
    targets = resolve_targets(model, caps({"layer": "layer2", "reduce": "mean"}, {"layer": "layer1"}))
    with Capturer(model, targets) as cap, torch.inference_mode():
        out = cap.run(torch.randn(2, 3, 64, 64))
    assert calls == []
    assert out["layer2"].shape == (2, 128)


def test_unknown_layer_lists_closest_names():
    from torchvision.models import resnet18

    with pytest.raises(LayerError) as err:
        resolve_targets(resnet18(), caps({"layer": "layer5"}))
    msg = str(err.value)
    assert "capture[0].layer 'layer5'" in msg and "layer4" in msg and "extractor layers" in msg
    with pytest.raises(LayerError, match="matches no module"):
        resolve_targets(resnet18(), caps({"layer": "layer4.*.conv9"}))


def test_globs_expand_in_module_order_and_key_needs_one_layer():
    from torchvision.models import resnet18

    targets = resolve_targets(resnet18(), caps({"layer": "layer4.*.conv2", "reduce": "mean"}))
    assert [t.key for t in targets] == ["layer4.0.conv2", "layer4.1.conv2"]
    # `*` stays inside one name part, `**` crosses parts, [..] is a class
    assert [t.layer for t in resolve_targets(resnet18(), caps({"layer": "layer4.*"}))] == ["layer4.0", "layer4.1"]
    assert len(resolve_targets(resnet18(), caps({"layer": "**.conv2"}))) == 8
    assert [t.layer for t in resolve_targets(resnet18(), caps({"layer": "layer[2-3]"}))] == ["layer2", "layer3"]
    with pytest.raises(LayerError, match="matches 2 layers"):
        resolve_targets(resnet18(), caps({"layer": "layer4.*.conv2", "key": "x"}))
    with pytest.raises(LayerError, match="both write 'fc'"):
        resolve_targets(resnet18(), caps({"layer": "fc"}, {"layer": "fc", "reduce": "none"}))


@pytest.mark.parametrize("key", ["target", "status", "shard_stats", "byte_offset", "lease", "cam.range"])
def test_keys_the_store_uses_for_its_own_arrays_are_refused(key: str):
    from torchvision.models import resnet18

    with pytest.raises(LayerError, match=f"capture\\[1\\]: key '{key}' is reserved by the store"):
        resolve_targets(resnet18(), caps({"layer": "layer4", "what": "gradcam", "key": "cam"},
                                         {"layer": "layer3", "reduce": "mean", "key": key}))


@pytest.mark.parametrize(("reduce", "shape"), [("none", (5, 7)), ("mean", (7,)), ("max", (7,)), ("cls", (7,)),
                                               ("flatten", (35,))])
def test_token_reductions(reduce: str, shape: tuple[int, ...]):
    from extractor.model.reduce import reduce_tensor

    t = torch.randn(2, 5, 7)
    out = reduce_tensor(t, reduce, "x")
    assert tuple(out.shape[1:]) == shape
    expected = {"none": t, "mean": t.mean(1), "max": t.amax(1), "cls": t[:, 0], "flatten": t.reshape(2, 35)}[reduce]
    torch.testing.assert_close(out, expected)
    with pytest.raises(LayerError, match="reduce: none"):
        reduce_tensor(torch.randn(2, 7), "mean", "fc output")


def test_input_index_takes_a_key_of_a_dict_argument_or_a_keyword_argument():
    class Head(torch.nn.Module):
        def forward(self, d: dict, scale: torch.Tensor | None = None) -> torch.Tensor:
            return d["vec"] * 2

    class DictIn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head, self.tail = Head(), Head()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.tail({"vec": self.head({"vec": x.mean((2, 3)), "map": x})}, scale=x.amax((1, 2, 3)))

    x = torch.randn(2, 3, 8, 8)
    targets = resolve_targets(DictIn(), caps({"layer": "head", "what": "input", "index": "vec", "key": "v"},
                                             {"layer": "tail", "what": "input", "index": "scale", "key": "s"}))
    with Capturer(DictIn(), targets) as cap, torch.inference_mode():
        out = cap.run(x)
    torch.testing.assert_close(out["v"], x.mean((2, 3)))  # a key of the one positional argument
    torch.testing.assert_close(out["s"], x.amax((1, 2, 3)))  # a keyword argument
