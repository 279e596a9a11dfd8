from __future__ import annotations

from pathlib import Path

import pytest
import torch

from extractor.errors import ModelError
from extractor.model.build import build_model, layer_table, state_dict_hash
from extractor.spec.model_spec import ModelSpec


def test_random_init_is_seeded_and_described():
    a, info = build_model(ModelSpec(name="resnet18", weights=None))
    b, _ = build_model(ModelSpec(name="resnet18", weights=None))
    assert state_dict_hash(a) == state_dict_hash(b) == info["state_dict_sha256"]
    assert info["parameters"] == 11_689_512 and "random init (seed 0)" in info["weights"]
    assert not a.training


def test_checkpoint_loads_with_weights_only(tmp_path: Path):
    from torchvision.models import resnet18

    torch.manual_seed(123)
    trained = resnet18()
    torch.save({"state_dict": trained.state_dict()}, tmp_path / "ckpt.pt")
    _model, info = build_model(ModelSpec(name="resnet18", weights=str(tmp_path / "ckpt.pt")))
    assert info["state_dict_sha256"] == state_dict_hash(trained)
    assert info["weights"] == f"torchvision resnet18, weights from checkpoint {tmp_path / 'ckpt.pt'}"


def test_checkpoint_with_pickled_code_is_refused(tmp_path: Path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ModelError, match="weights_only=True"):
        build_model(ModelSpec(name="resnet18", weights=str(tmp_path / "evil.pt")))


def test_checkpoint_for_another_model_names_the_keys(tmp_path: Path):
    from torchvision.models import resnet34

    torch.save(resnet34().state_dict(), tmp_path / "r34.pt")
    with pytest.raises(ModelError, match="unexpected keys"):
        build_model(ModelSpec(name="resnet18", weights=str(tmp_path / "r34.pt")))
    with pytest.raises(ModelError, match="does not exist"):
        build_model(ModelSpec(name="resnet18", weights=str(tmp_path / "missing.pt")))


def test_weights_names_come_from_the_torch_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.delenv("EXTRACTOR_ALLOW_DOWNLOAD", raising=False)
    with pytest.raises(ModelError, match=r"not in the torch cache .*resnet18-f37072fd\.pth"):
        build_model(ModelSpec(name="resnet18", weights="IMAGENET1K_V1"))
    with pytest.raises(ModelError, match="valid: DEFAULT, IMAGENET1K_V1"):
        build_model(ModelSpec(name="resnet18", weights="IMAGENET22K"))
    # a cached file is used as is: put a state dict where torchvision looks for it
    from torchvision.models import resnet18

    ckpt = tmp_path / "hub" / "checkpoints"
    ckpt.mkdir(parents=True)
    torch.manual_seed(5)
    ref = resnet18()
    torch.save(ref.state_dict(), ckpt / "resnet18-f37072fd.pth")
    _model, info = build_model(ModelSpec(name="resnet18", weights="IMAGENET1K_V1"))
    assert info["state_dict_sha256"] == state_dict_hash(ref)


def test_unknown_model_and_bad_factory():
    with pytest.raises(ModelError, match="closest: resnet50"):
        build_model(ModelSpec(name="resnet5O"))
    with pytest.raises(ModelError, match="cannot import no_such_pkg"):
        build_model(ModelSpec(name=None, factory="no_such_pkg.mod:build"))
    with pytest.raises(ModelError, match="has no attribute"):
        build_model(ModelSpec(name=None, factory="toy_models:nope"))
    with pytest.raises(ModelError, match=r"not a torch.nn.Module"):
        build_model(ModelSpec(name=None, factory="os:getcwd"))


def test_layer_table_shapes():
    model, _ = build_model(ModelSpec(name=None, factory="toy_models:tutorial_net"))
    rows = {r["name"]: r for r in layer_table(model, 4)}
    assert rows["conv"]["output"] == "1x2x2x2" and rows["pool"]["output"] == "1x2x1x1"
    assert rows["conv"]["parameters"] == 2 * 9 + 2
