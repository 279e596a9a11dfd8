"""The README and the docs site stay true (issue 56): the site builds strictly, its reference of every spec field
generated from the schema; the README's commands and its Python example run as written, and the quick start's
reading example runs on the store they make."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.processes import cli
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _fields(model: type[BaseModel]) -> set[str]:
    """Every field name of a spec section and of the sections inside it."""
    from extractor.spec.reference import _model_of

    out = set(model.model_fields)
    for field in model.model_fields.values():
        inner = _model_of(field.annotation)
        if inner is not None:
            out |= _fields(inner)
    return out


def test_the_docs_site_builds_strictly_with_every_field_of_the_spec(tmp_path: Path):
    from extractor.spec.schema import JobSpec

    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "site" / "reference" / "fields" / "index.html").read_text()
    missing = [f for f in sorted(_fields(JobSpec)) if f"<code>{f}</code>" not in html]
    assert not missing, f"the spec's reference page does not list {missing}"
    for page in ("guides/sae", "guides/python", "reference/store", "quickstart"):
        assert (tmp_path / "site" / page / "index.html").exists(), page
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.slow  # a demo store, then each command on it
def test_the_readme_and_the_quick_start_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobs").mkdir()
    shutil.copy(ROOT / "jobs" / "demo.yaml", tmp_path / "jobs" / "demo.yaml")
    made = cli("demo", "--dir", "demo", "--per-class", "5", "-q", "--set", "data.crop=32", "--set", "data.resize=40")
    assert made.returncode == 0, made.stderr
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index("## After `make demo`"):]
    commands = [shlex.split(line.split("  #")[0]) for line in _blocks(after, "sh")[0].splitlines() if line.strip()]
    assert all(c[0] == ".venv/bin/extractor" for c in commands) and len(commands) >= 5
    for command in commands:
        if command[1:] == ["view", "demo/demo.zarr"]:
            continue  # the app, serving until stopped: tests/view/test_view.py runs `extractor view` so
        done = cli(*command[1:])
        assert done.returncode == 0, (command, done.stderr)
    assert (tmp_path / "demo" / "site" / "index.html").exists()
    namespace: dict = {}
    exec(compile(_blocks(readme, "python")[0], "README.md", "exec"), namespace)
    assert namespace["embedding"].shape == (32, 512)
    quick = (ROOT / "docs" / "quickstart.md").read_text()
    namespace = {}
    exec(compile(_blocks(quick, "python")[0], "quickstart.md", "exec"), namespace)
    assert namespace["x"].shape == (20, 512) and len(namespace["ds"]["embedding"]) == 20
