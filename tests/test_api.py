"""The Python API: extractor.run(job, model=...) returns the store; a module made in Python runs on
the local backend and on a real embedded Ray as the CLI runs the same spec by name."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import warm
import yaml
from helpers.jobs import RESNET18, job
from helpers.processes import child_env

import extractor
from extractor.errors import ClusterError, SpecError

TESTS = Path(__file__).resolve().parent


def _resnet18() -> torch.nn.Module:
    """The weights `model.name: resnet18, weights: null` gets (seed 0), made in Python."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return resnet18()


def _no_model(raw: dict) -> dict:
    """The job without its model section, for a module given as model= (which carries no preprocessing:
    ImageNet's, as the named torchvision model's random init takes)."""
    return {**raw, "model": {"device": "cpu"}, "data": {**raw["data"], "preprocess": "imagenet"}}


@pytest.mark.slow
def test_run_from_python_with_a_module_equals_the_cli_run_of_the_named_model(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "cli.zarr", model=RESNET18)  # the named model, against _resnet18() below
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    env = child_env()
    r = warm.run([sys.executable, "-m", "extractor.cli", "run", str(tmp_path / "job.yaml"), "-q"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    model = _resnet18()
    model.train()
    flags = [p.requires_grad for p in model.parameters()]
    assert model.conv1.weight.is_contiguous() and raw.get("model", {}).get("channels_last", True)
    store = extractor.run({**_no_model(raw), "output": {**raw["output"], "store": str(tmp_path / "py.zarr")}},
                          model=model, progress=False)
    cli = extractor.open_store(str(tmp_path / "cli.zarr"))
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(store.numpy(key), cli.numpy(key))
    assert store.model["name"] == "python:torchvision.models.resnet.ResNet"
    assert store.model["state_dict_sha256"] == cli.model["state_dict_sha256"]
    assert store.model["weights"] == "python object torchvision.models.resnet.ResNet (weights as given)"
    assert [p.requires_grad for p in model.parameters()] == flags and model.training  # given back as it was
    assert all(p.is_contiguous() for p in model.parameters())  # the job ran it channels_last
    assert "12 ok, 0 failed, 0 pending rows; 3 shards run" in store.last_run.report()
    assert "12 ok" in repr(store) and "complete" in repr(store)


def _as_given(model: torch.nn.Module) -> tuple[list[bool], list[bool], list[tuple[int, ...]]]:
    return ([m.training for m in model.modules()], [p.requires_grad for p in model.parameters()],
            [p.stride() for p in model.parameters()])


def test_a_module_comes_back_as_given_after_a_run_and_after_a_failed_one(image_dir: Path, tmp_path: Path):
    """Each module's mode (a training model with frozen BatchNorm), requires_grad and strides (a
    channels_last job makes 1x1 conv weights (64, 1, 64, 64)), also when the job cannot start."""
    from extractor.errors import LayerError

    model = _resnet18().train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    model.layer1.requires_grad_(False)
    before = _as_given(model)
    raw = _no_model(job(image_dir, tmp_path / "py.zarr"))
    extractor.run(raw, model=model, progress=False)
    assert _as_given(model) == before
    with pytest.raises(LayerError, match=r"List the layers with `\[name for name, _ in model.named_modules"):
        extractor.run({**raw, "capture": [{"layer": "nope"}], "output": {**raw["output"], "if_exists": "overwrite"}},
                      model=model, progress=False)
    assert _as_given(model) == before


def test_a_path_with_overrides_and_a_job_that_also_names_a_model(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr", model=RESNET18, capture=[{"layer": "(model)", "key": "logits"}])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    store = extractor.run(tmp_path / "job.yaml", overrides=["data.batch_size=5", "output.chunk_rows=4"],
                          progress=False)
    assert store["logits"].shape == (12, 1000) and store.spec["data"]["batch_size"] == 5
    with pytest.raises(SpecError, match=r"model= was given, and the job names a model too \(model.name\)"):
        extractor.run(raw, model=_resnet18())


@pytest.mark.slow
def test_a_module_from_python_runs_on_ray_as_locally(ray_cluster, image_dir: Path, tmp_path: Path):
    raw = _no_model(job(image_dir, tmp_path / "local.zarr"))
    local = extractor.run(raw, model=_resnet18(), progress=False)
    remote = extractor.run({**raw, "output": {**raw["output"], "store": str(tmp_path / "ray.zarr")},
                            "cluster": {"backend": "ray", "workers": 1, "cpus_per_worker": 2}},
                           model=_resnet18(), progress=False)
    assert remote.last_run.workers and os.getpid() not in remote.last_run.workers[0]["pids"]
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(local.numpy(key), remote.numpy(key))


class _Unpicklable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean((2, 3))


def test_a_module_that_does_not_pickle_is_refused_for_ray_before_it_starts(image_dir: Path, tmp_path: Path):
    raw = _no_model(job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "conv", "reduce": "mean"}],
                        cluster={"backend": "ray"}))
    with pytest.raises(ClusterError, match=r"model= \(_Unpicklable\) cannot be sent to Ray workers: it does not "
                                           r"pickle .*cluster.backend: local"):
        extractor.run(raw, model=_Unpicklable(), progress=False)
    assert not (tmp_path / "s.zarr").exists()
    raw["cluster"] = {"backend": "local"}
    raw["data"] = {**raw["data"], "preprocess": "imagenet"}
    assert extractor.run(raw, model=_Unpicklable(), progress=False)["conv"].shape == (12, 4)


def test_the_python_guide_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import re

    text = (TESTS.parent / "docs" / "guides" / "python.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "python.md", "exec"), namespace)
    assert dict(namespace["sweep"].sizes) == {"layer": 4, "row": 32, "token": 17, "feature": 384}
    assert namespace["cnn"]["embedding"].shape == (32, 512)


@pytest.mark.slow
def test_the_sae_example_runs(tmp_path: Path):
    r = subprocess.run([sys.executable, str(TESTS.parent / "examples" / "sae_quickstart.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "steps; loss" in r.stdout and "32 rows" in r.stdout and "FeatureIndex resid@sae" in r.stdout


def test_a_float16_overflow_is_reported_as_such(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr", model={"name": None, "factory": "toy_models:loud_net", "device": "cpu"},
              data={"preprocess": "imagenet"},
              capture=[{"layer": "loud", "dtype": "float16", "key": "half"}, {"layer": "loud", "key": "full"}])
    store = extractor.run(raw, progress=False)
    report = store.last_run.report()
    assert "rows of half hold NaN or Inf; half is stored as float16, where finite values beyond +-65,504 become " \
           "Inf" in report and "set its capture's dtype: float32" in report
    assert "of full hold" not in report and np.isfinite(store.numpy("full")).all()


def test_bad_arguments_are_one_line_errors(image_dir: Path, tmp_path: Path):
    with pytest.raises(SpecError, match="a YAML path, a dict or a JobSpec, not int"):
        extractor.run(42)
    raw = _no_model(job(image_dir, tmp_path / "s.zarr"))
    with pytest.raises(SpecError, match=r"model= takes a torch.nn.Module, not function"):
        extractor.run(raw, model=lambda x: x)
    raw = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer4", "reduce": "mean"}])
    store = extractor.run(raw, overrides="data.batch_size=5", progress=False)  # one override, as a string
    assert store.spec["data"]["batch_size"] == 5


def test_run_prints_the_size_estimate_as_the_command_does(image_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture):
    raw = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer4", "reduce": "mean"}])
    store = extractor.run(raw)
    err = capsys.readouterr().err
    assert f"{len(store)} images to process; 256 B per row uncompressed (layer4 256 B); store about 3.0 KiB" in err, err
