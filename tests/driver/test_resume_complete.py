"""A resume of a complete store whose record fixes what the job's model would measure (a torchvision builder with a
random init or its own weights, the same spec and versions) decides from that record: the model is not built and
torch not imported (issue 39: a resume with nothing to do costs seconds of CPU at a million rows, not 10 s of
imports). Every other resume builds and probes its model, as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import RESNET18, job
from helpers.processes import child_env

import extractor.driver.runner as runner
import extractor.store.provenance as provenance
from extractor.driver.runner import run
from extractor.spec.load import parse_spec
from extractor.store.provenance import kept_probe

SMALL = {"shard_size": 6, "resize": None, "crop": 32}
CAPTURE = [{"layer": "avgpool", "reduce": "flatten"}]


def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The backends the runner builds from now on (each builds the job's model), by the spec's model name."""
    made: list[str] = []
    real = runner._backend

    def backend(spec: Any) -> Any:
        made.append(str(spec.model.name or spec.model.factory))
        return real(spec)

    monkeypatch.setattr(runner, "_backend", backend)
    return made


@pytest.fixture(scope="module")
def complete(image_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A complete store of resnet18 (random init) over the 12 test images, and its job as plain data."""
    raw = job(image_dir, tmp_path_factory.mktemp("complete") / "s.zarr", model=RESNET18, data=SMALL,
              capture=CAPTURE)
    assert run(parse_spec(raw)).ok == 12
    raw["output"]["if_exists"] = "resume"
    return raw


def test_a_complete_store_resumes_from_its_record(complete: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    made = built(monkeypatch)
    summary = run(parse_spec(complete))
    assert (summary.shards_run, summary.shards_skipped, summary.ok) == (0, 2, 12)
    assert made == []  # no model built: the store's record says what it would measure


def test_other_versions_build_the_model(complete: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    made = built(monkeypatch)
    real = provenance.versions
    monkeypatch.setattr(provenance, "versions", lambda: {**real(), "torchvision": "0.0.1"})
    assert run(parse_spec(complete)).shards_run == 0
    assert made == ["resnet18"]  # another torchvision may build another model: probed as before


def test_another_spec_is_refused_as_before(complete: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    from extractor.errors import StoreError

    made = built(monkeypatch)
    changed = {**complete, "capture": [*CAPTURE, {"layer": "layer4", "reduce": "mean"}]}
    with pytest.raises(StoreError, match="made by a different job"):
        run(parse_spec(changed))
    assert made == ["resnet18"]


def test_only_a_model_the_spec_fixes_is_taken_from_the_record(complete: dict[str, Any]):
    from extractor.store import read_state

    old = read_state(complete["output"]["store"], None)
    spec = parse_spec(complete)
    assert kept_probe(spec, old) is not None
    assert kept_probe(spec, {**old, "status": "incomplete"}) is None  # shards to compute: the model is needed
    assert kept_probe(spec, {**old, "spec_digest": "0"}) is None
    assert kept_probe(spec, {**old, "versions": {**old["versions"], "torch": "1.0"}}) is None
    assert kept_probe(spec, None) is None
    for model in ({"name": None, "factory": "toy_models:tiny_resnet", "weights": None},  # its code can change
                  {**RESNET18, "weights": str(Path(complete["output"]["store"]).parent / "w.pth")},  # a file can
                  {"name": "timm:resnet18", "weights": "random"}):  # so can a library outside the versions kept
        other = parse_spec({**complete, "model": model})
        assert kept_probe(other, {**old, "spec_digest": provenance.spec_digest(other)}) is None


def test_the_command_imports_no_torch(complete: dict[str, Any], tmp_path: Path):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(complete))
    code = ("import sys; from extractor.cli import main; rc = main(['run', sys.argv[1], '-q']); "
            "print('torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code, str(spec)], capture_output=True, text=True, env=child_env(),
                         timeout=300)
    assert "0 shards run, 2 already done" in out.stdout, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False 0"
