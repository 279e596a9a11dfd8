"""model.compile: hooks registered before torch.compile are traced into the graph, and the
compiled model stores the same values as the eager one (early stop and gradients included)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import job

from extractor import open_store
from extractor.runner import run
from extractor.spec import parse_spec


def _run(image_dir: Path, store: Path, compile_: bool, capture: list[dict]) -> dict[str, np.ndarray]:
    spec = parse_spec(job(
        image_dir, store,
        model={"name": None, "factory": "toy_models:small_cnn", "device": "cpu", "compile": compile_},
        data={"shard_size": 4, "batch_size": 3, "decode_workers": 1},  # shards of 4: batches of 3 and 1
        capture=capture,
    ))
    summary = run(spec)
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
