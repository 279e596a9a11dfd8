"""A submitted job checks the cluster's packages against the submitting machine's (issue 19)."""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata

import pytest

from extractor.driver.environment import SUBMITTED, check_environment, check_submitted, environment
from extractor.errors import ClusterError


def test_the_submitting_machine_records_extractors_requirements_and_their_versions():
    env = environment()
    assert "torch>=2.8" in env["requires"] and env["versions"]["torch"] == metadata.version("torch")
    assert env["python"] == platform.python_version() and not any("extra ==" in r for r in env["requires"])


def test_the_same_packages_pass_and_a_different_torch_is_a_warning():
    env = environment()
    assert check_environment(env) == []
    other = {**env, "versions": {**env["versions"], "torch": "2.8.0", "tqdm": "1.0"}}
    assert check_environment(other) == [f"torch {metadata.version('torch')} (submitted from 2.8.0)"]  # tqdm: no


def test_a_missing_or_too_old_package_is_one_error_naming_each_and_the_fix(monkeypatch: pytest.MonkeyPatch):
    env = environment()
    env = {**env, "requires": [*env["requires"], "no-such-package-xyz", "numpy>=999"],
           "versions": {**env["versions"], "no-such-package-xyz": "1.2"}}
    with pytest.raises(ClusterError, match=r"cannot run extractor: missing no-such-package-xyz==1.2; too old: numpy "
                                           r".* \(extractor needs numpy>=999\)\. List them in submit.pip") as err:
        check_environment(env)
    assert f"the cluster's Python ({sys.executable}, {platform.python_version()})" in str(err.value)  # which one
    monkeypatch.setenv(SUBMITTED, json.dumps(env))
    with pytest.raises(ClusterError, match="no-such-package-xyz"):
        check_submitted()
    monkeypatch.delenv(SUBMITTED)
    assert check_submitted() == []  # not a submitted job: nothing to compare


def test_a_stores_versions_are_what_the_packages_say_and_read_without_importing_them():
    """A store records each package's ``__version__`` (torch's with its build) read from the installed files: a
    job that does not use torchvision does not pay for importing it on every run and resume."""
    import subprocess

    code = ("import sys, json; from extractor.store.provenance import versions; v = versions(); "
            "print(json.dumps([v, [m for m in ('torch', 'torchvision') if m in sys.modules]]))")
    said, imported = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                               check=True).stdout)
    assert imported == []
    import numpy
    import torch
    import torchvision
    import zarr

    assert {k: said[k] for k in ("torch", "torchvision", "zarr", "numpy")} == {
        "torch": torch.__version__, "torchvision": torchvision.__version__, "zarr": zarr.__version__,
        "numpy": numpy.__version__}


def test_a_job_python_without_ray_is_told_to_set_the_path_to_the_clusters(monkeypatch: pytest.MonkeyPatch):
    """issue 54: on a running Ray cluster (it started the job), a `python` without ray is another interpreter found
    first on the job's PATH; the hint listed ray as missing (for submit.pip) and never named submit.env_vars.PATH."""
    env = environment()
    env = {**env, "requires": [*env["requires"], "no-such-package-xyz"]}
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    real = metadata.version

    def without_ray(name: str) -> str:
        if name == "ray":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", without_ray)
    with pytest.raises(ClusterError) as err:
        check_environment(env)
    said = str(err.value)
    assert said.startswith(f"the job's python ({sys.executable}) is not the Python the Ray cluster runs: it has no "
                           "ray (and lacks 2 of extractor's requirements in all), so the job's PATH (/usr/bin:/bin) "
                           "found another first. Set submit.env_vars.PATH to the cluster's"), said
    assert "submit.pip" not in said and "\n" not in said
