"""No secret stored (issue 54, T5-4): every command that takes storage options (``run`` through its spec and
``--set``, the store commands through ``--storage-option``) leaves none of their secret values in any object of
the store, in what it writes beside it, or in what it prints and logs, on a local store and on S3 (the moto
server). ``extractor index`` stored its whole command line, secrets included, in its lease record and the
root's metadata; claimant records keep the command that runs (``sys.argv``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import job
from helpers.processes import cli

from extractor.spec import REDACTED, redact_argv

KEY, SECRET = "AKIDEXAMPLE7Q3ZK4WJ", "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"  # both must never be written
LEAKS = (KEY.encode(), SECRET.encode())


def _commands(store: str, spec: Path, options: dict[str, Any], out: Path, readers: bool = True
              ) -> Iterator[list[str]]:
    """Every command that takes storage options, as a user would give them the secrets (``readers``: those that
    only read the store and write beside it too)."""
    given = [x for k, v in options.items() for x in ("--storage-option", f"{k}={v}")]
    yield ["run", str(spec), "--set", f"output.storage_options.secret={SECRET}", "-q"]
    yield ["run", str(spec), "--resume", "--set", f"output.storage_options.key={KEY}", "-q"]
    yield ["index", store, "--key", "layer4", "-q", *given]
    yield ["index", store, "--key", "layer4", "--feature", "0", "--out", str(out / "feature.png"), *given]
    yield ["inspect", store, "--verify", "--objects", "--json", *given]
    if not readers:
        return
    yield ["show", store, "--rows", "0:4", "--out", str(out / "show.png"), *given]
    yield ["probe", store, "--folds", "2", "--json", *given]
    yield ["compare", f"{store}:layer4", f"{store}:layer3", "--rows", "6", "--rsa-rows", "6", "--json", *given]
    yield ["view", store, "--export", str(out / "site"), "--features", "2", "--images", "2", *given]


def _objects(store: str, options: dict[str, Any]) -> dict[str, bytes]:
    """Every object under the store, by its key."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(store, **options)
    fs.invalidate_cache()
    return {path: fs.cat_file(path) for path in fs.find(base)}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """Where the store goes, and the storage options that reach it (the secrets among them)."""
    if request.param == "local":
        return str(tmp_path / "s.zarr"), {"key": KEY, "secret": SECRET}
    import s3fs

    endpoint = request.getfixturevalue("moto_s3")["endpoint_url"]  # moto takes any credentials
    options = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
    s3fs.S3FileSystem(**options).mkdir("redaction")
    return f"s3://redaction/{tmp_path.name}.zarr", options


def _leaked(store: str, options: dict[str, Any], out: Path) -> list[str]:
    """The objects of the store and the files written beside it that hold a secret."""
    written = {**_objects(store, options), **_files(out)}
    assert any("/__txn/claimants/" in name for name in written)  # the records that keep a command line are there
    return sorted(name for name, data in written.items() if any(leak in data for leak in LEAKS))


def test_no_command_leaves_a_secret_in_the_store_or_its_output(image_dir: Path, tmp_path: Path,
                                                               place: tuple[str, dict[str, Any]],
                                                               monkeypatch: pytest.MonkeyPatch):
    import extractor

    store, options = place
    raw = job(image_dir, Path(store), output={"store": store, "storage_options": options, "chunk_rows": 2},
              capture=[{"layer": "layer3", "reduce": "none", "feature_index": {"k": 2}},
                       {"layer": "layer4", "reduce": "mean"}])
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    out.mkdir()
    # on S3 (moto: 4 s a command), the commands that write into the store, and a reader; the others read it as
    # they read a local store, their output checked there
    for args in _commands(store, spec, options, out, readers=not store.startswith("s3://")):
        monkeypatch.setattr(sys, "argv", ["extractor", "-vv", *args])  # what a claimant's record keeps
        done = cli("-vv", *args)
        assert done.returncode == 0, (args, done.stderr[-2000:])
        assert not any(leak.decode() in done.stdout + done.stderr for leak in LEAKS), args
        assert _leaked(store, options, out) == [], args
    # a Python program that runs a job: its claimant's record keeps the program's command line, given secrets
    monkeypatch.setattr(sys, "argv", ["train.py", "--storage-option", f"secret={SECRET}", "--aws-access-key-id", KEY,
                                      f"--password={SECRET}", f"https://me:{SECRET}@example.org/data"])
    extractor.run({**raw, "output": {**raw["output"], "if_exists": "overwrite"}}, progress=False)
    assert _leaked(store, options, out) == []


def test_a_command_line_is_kept_without_its_secrets():
    """The one rule for a command line a record keeps: storage options by their key (an endpoint stays), ``--set``
    overrides as the spec they make is redacted, flags that name a secret, values that look like one, a URL's
    password."""
    argv = ["extractor", "index", "s3://b/s.zarr", "--storage-option", f"secret={SECRET}",
            f"--storage-option=key={KEY}", "--storage-option", "endpoint_url=http://127.0.0.1:9000",
            "--set", f"output.storage_options.secret={SECRET}", "--set=data.batch_size=8",
            "--token", "abc", f"--password={SECRET}", "hf_abcdefghijklmnopqrstuvwxyz", "https://me:pw@host/x",
            "--name", "layer4", "train.py"]
    assert redact_argv(argv) == [
        "extractor", "index", "s3://b/s.zarr", "--storage-option", f"secret={REDACTED}",
        f"--storage-option=key={REDACTED}", "--storage-option", "endpoint_url=http://127.0.0.1:9000",
        "--set", f"output.storage_options.secret={REDACTED}", "--set=data.batch_size=8",
        "--token", REDACTED, f"--password={REDACTED}", REDACTED, f"https://me:{REDACTED}@host/x",
        "--name", "layer4", "train.py"]


def test_every_record_keeps_a_url_without_its_password():
    from extractor.spec import redact

    record = {"reused_from": ["https://me:pw@host/s.zarr", "s3://bucket/s.zarr"], "error": "at ftp://a:b@c/d: gone",
              "data": {"storage_options": {"secret": "s", "endpoint_url": "http://127.0.0.1:9000"}}}
    assert redact(record) == {"reused_from": [f"https://me:{REDACTED}@host/s.zarr", "s3://bucket/s.zarr"],
                              "error": f"at ftp://a:{REDACTED}@c/d: gone",
                              "data": {"storage_options": {"secret": REDACTED, "endpoint_url": "http://127.0.0.1:9000"}}}
