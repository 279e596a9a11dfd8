"""model.compile: hooks registered before torch.compile are traced into the graph, and the
compiled model stores the same values as the eager one (early stop and gradients included)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import job
from helpers.stores import pending

from extractor import open_store
from extractor.driver.runner import run
from extractor.spec.load import parse_spec


def _spec(image_dir: Path, store: Path, compile_: bool, capture: list[dict], **output: str):
    return parse_spec(job(
        image_dir, store,
        model={"name": None, "factory": "toy_models:small_cnn", "device": "cpu", "compile": compile_},
        data={"shard_size": 4, "batch_size": 3, "decode_workers": 1},  # shards of 4: batches of 3 and 1
        capture=capture, output={"store": str(store), **output},
    ))


def _run(image_dir: Path, store: Path, compile_: bool, capture: list[dict]) -> dict[str, np.ndarray]:
    summary = run(_spec(image_dir, store, compile_, capture))
    assert summary.ok == summary.rows == 12
    s = open_store(str(store))
    return {k: s.numpy(k) for k in s.captures} | {k: np.asarray(s.group[k][:]) for k in s.attrs.get("extras", {})}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["forward", "gradients"])
def test_compiled_model_captures_the_same_values(image_dir: Path, tmp_path: Path, kind: str):
    import torch._dynamo.utils

    capture = (
        [{"layer": "stem", "reduce": "none"}, {"layer": "relu", "what": "input", "reduce": "mean"},
         {"layer": "layer1.0", "reduce": "max"}]  # layer1.0 is the last target: the forward stops there
        if kind == "forward" else
        [{"layer": "layer1.0", "what": "gradcam", "target": "predicted"},
         {"layer": "bn", "what": "grad_output", "reduce": "mean"}]
    )
    eager = _run(image_dir, tmp_path / "eager.zarr", False, capture)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _run(image_dir, tmp_path / "compiled.zarr", True, capture)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs, "nothing was compiled"
    assert eager.keys() == compiled.keys() and len(eager) >= 3
    for key in eager:
        assert np.isfinite(eager[key]).all(), key
        np.testing.assert_allclose(compiled[key], eager[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_a_failing_compile_is_a_model_error_before_any_image(image_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    import torch

    from extractor.errors import ModelError

    def broken(model, **kwargs):
        def forward(x):
            raise RuntimeError("inductor: no C++ compiler")  # what a machine without one says, roughly
        return forward

    monkeypatch.setattr(torch, "compile", broken)
    msg = r"model.compile: torch.compile failed.*no C\+\+ compiler.*model.compile: false"
    with pytest.raises(ModelError, match=msg):
        _run(image_dir, tmp_path / "s.zarr", True, [{"layer": "stem"}])
    assert not (tmp_path / "s.zarr").exists()  # nothing was created


def test_the_model_compiles_once_before_the_store_and_not_for_a_resume_with_nothing_left(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Compiling takes tens of seconds: a run compiles once (on a blank batch, before its store
    exists), a resume with shards left compiles before its first image, one with none compiles nothing."""
    import torch

    store = tmp_path / "s.zarr"
    calls: list[bool] = []  # per call of the compiled forward: whether the store existed then

    def counting(model, **kwargs):
        def forward(*args, **kw):
            calls.append(store.exists())
            return model(*args, **kw)
        return forward

    monkeypatch.setattr(torch, "compile", counting)
    _run(image_dir, store, True, [{"layer": "stem", "reduce": "mean"}])
    assert calls == [False] + [True] * 6  # the warm-up, then 3 shards x 2 batches
    calls.clear()
    summary = run(_spec(image_dir, store, True, [{"layer": "stem", "reduce": "mean"}], if_exists="resume"))
    assert summary.shards_run == 0 and summary.ok == 12 and calls == []
    pending(str(store), [2])  # as if the job had stopped before its last shard
    summary = run(_spec(image_dir, store, True, [{"layer": "stem", "reduce": "mean"}], if_exists="resume"))
    assert summary.shards_run == 1 and len(calls) == 3  # the warm-up, then the shard's 2 batches


@pytest.mark.parametrize(("raised", "error", "words"), [
    ("OutOfMemoryError", "ModelError", r"out of memory on the cpu while compiling the model on a full batch of 3 "
                                       r"\(data.batch_size\): lower data.batch_size"),
    ("AcceleratorError", "DeviceError", "the cpu device failed while compiling the model: .*illegal memory access"),
])
def test_memory_and_device_failures_while_compiling_are_named(image_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, raised, error, words):
    import torch

    from extractor import errors

    def broken(model, **kwargs):
        def forward(x):
            raise getattr(torch, raised)("CUDA error: an illegal memory access was encountered")
        return forward

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(getattr(errors, error), match=words):
        _run(image_dir, tmp_path / "s.zarr", True, [{"layer": "stem"}])
    assert not (tmp_path / "s.zarr").exists()
