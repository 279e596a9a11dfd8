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
