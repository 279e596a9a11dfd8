"""`extractor submit` to a Ray cluster whose Python lacks extractor (issue 19): the package is
shipped with the job. Its own module: its head must not run beside test_remote's (one
dashboard agent port per machine)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.cluster import VENV_BIN, extractor, jobs_head, start_head
from helpers.jobs import job

from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

TESTS = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


HIDE_EXTRACTOR = '''\
# sitecustomize of a Ray head "whose image lacks extractor": the venv's editable install is hidden
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable___extractor")]
'''


@pytest.fixture(scope="module")
def bare_head(tmp_path_factory: pytest.TempPathFactory):
    """A `ray start --head` on loopback whose Python has torch, Ray and zarr but cannot import
    extractor (the venv's editable install hidden by a sitecustomize on PYTHONPATH), as on a
    cluster whose image does not have it; its processes killed by pid at the end."""
    hide = tmp_path_factory.mktemp("hide")
    (hide / "sitecustomize.py").write_text(HIDE_EXTRACTOR)
    with jobs_head("rayb", PYTHONPATH=str(hide)) as (address, env, tmp):
        probe = subprocess.run([str(VENV_BIN / "python"), "-c", "import extractor"], env=env, cwd=tmp,
                               capture_output=True, text=True)
        assert probe.returncode != 0 and "No module named 'extractor'" in probe.stderr  # the setup holds
        start_head(address, env, tmp)
        yield address


def test_submit_ships_extractor_to_a_cluster_that_lacks_it(bare_head, image_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    """issue 19: the cluster's Python has no extractor. `submit --no-ship` fails there as it did
    (No module named 'extractor'); `submit` sends the installed package (and the model.factory
    module of the current folder) and the job's store equals a local run."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_factory.py").write_text("import torchvision\n\n\ndef small():\n"
                                            "    return torchvision.models.resnet18(num_classes=3)\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS)}  # the submitting side: extractor installed, as usual
    raw = job(image_dir, tmp_path / "s.zarr", model={"name": None, "factory": "my_factory:small", "device": "cpu"},
              data={"shard_size": 4, "batch_size": 4, "preprocess": "imagenet"},
              cluster={"backend": "ray", "workers": 1, "cpus_per_worker": 1})
    raw["output"].pop("chunk_rows")  # auto: 4 rows, from the shard size
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    r = extractor("submit", str(spec), "--address", bare_head, "--wait", "--no-ship", env=env, timeout=300)
    assert r.returncode == 1 and "No module named 'extractor'" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    r = extractor("submit", str(spec), "--address", bare_head, "--wait", env=env, timeout=400)
    assert r.returncode == 0 and "12 ok, 0 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    local = {**raw, "output": {**raw["output"], "store": str(tmp_path / "local.zarr")}, "cluster": {"backend": "local"}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the cluster's worker (cpus_per_worker: 1): oneDNN's sums depend on it
    try:
        run(parse_spec(local))
    finally:
        torch.set_num_threads(threads)
    a, b = open_store(str(tmp_path / "local.zarr")), open_store(str(tmp_path / "s.zarr"))
    assert b.attrs["chunk_rows"] == {"layer3": 4, "layer4": 4} and b.attrs["status"] == "complete"
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))
