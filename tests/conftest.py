"""Shared fixtures: real image files on disk and job specs small enough for 2 CPU cores."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.images import make_images
from helpers.processes import child_env, free_port

# Tests mirror the package (tests/data/ tests extractor/data/, ...); what several test files share is in the
# package tests/helpers/ (``from helpers.jobs import job``), never imported from a test file or from here.
TESTS = Path(__file__).resolve().parent

# Ray started by any test binds to loopback only and needs no token (see shared NOTES.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Seconds the longest files took in a whole run (tests/file_seconds.json, written by `make durations` from a run's
# `--durations=0`). `make test` hands whole files to its processes longest first (xdist's own order is by number of
# tests), so a long file never starts last and runs on alone. A file not listed is estimated from its tests' markers.
FILE_SECONDS: dict[str, float] = json.loads((TESTS / "file_seconds.json").read_text())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (see FILE_SECONDS); a file's tests keep their order."""
    guess: dict[str, float] = {}
    for item in items:
        file = os.path.relpath(item.path, TESTS)
        guess[file] = guess.get(file, 0.0) + (20.0 if item.get_closest_marker("slow") else 0.3)
    cost = {file: FILE_SECONDS.get(file, seconds) for file, seconds in guess.items()}
    items.sort(key=lambda item: -cost[os.path.relpath(item.path, TESTS)])








@pytest.fixture(scope="session")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    make_images(root)
    return root


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[dict[str, str]]:
    """One S3-compatible server for the session: moto in this process (a thread) on 127.0.0.1; its
    ``storage_options``. Each test module makes and uses its own bucket. (A server with other settings,
    or a patched handler, is started by its test: tests/driver/test_remote.py, tests/store/test_fence.py.)"""
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    server.stop()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A Ray instance in this process on loopback (2 CPUs, a short temp dir: Ray's socket paths must stay under
    107 bytes), shared by a module's tests, as Ray's own ``ray_start_regular_shared``. Module-scoped, not
    session-scoped: an idle Ray holds about 750 MB and some CPU through every other file, and
    tests/driver/test_nodes.py connects this process to a cluster of its own. Workers import ``toy_models``."""
    ray = pytest.importorskip("ray")
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, configure_logging=False)
    yield
    ray.shutdown()










