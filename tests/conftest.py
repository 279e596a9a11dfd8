"""Shared fixtures: real image files on disk and job specs small enough for 2 CPU cores."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Tests mirror the package (tests/data/ tests extractor/data/, ...); helpers one test file shares with others are
# imported by module name (``from test_sources import write_tars``): every test folder is on the path, and no two
# test files share a name.
TESTS = Path(__file__).resolve().parent
sys.path[1:1] = [str(p) for p in sorted(TESTS.iterdir()) if p.is_dir() and p.name.isidentifier()
                 and str(p) not in sys.path]

# Ray started by any test binds to loopback only and needs no token (see shared NOTES.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Seconds the longest files took in a whole run (`--durations=0`, summed per file; 2026-12-02, 2 cores, loaded).
# `make test` hands whole files to its processes longest first (xdist's own order is by number of tests), so a
# long file never starts last and runs on alone. A file not listed is estimated from its tests' markers.
FILE_SECONDS = {
    "driver/test_ray.py": 253, "driver/test_ray_driver.py": 211, "driver/test_remote.py": 199,
    "store/test_fence.py": 196, "driver/test_nodes.py": 180, "driver/test_reliability.py": 162,
    "test_api.py": 161, "index/test_post_hoc.py": 115, "model/test_channels_last.py": 96,
    "model/test_model_sources.py": 93, "driver/test_submit_ship.py": 77, "view/test_view.py": 70,
    "test_cli.py": 57, "store/test_layout.py": 54, "read/test_reader.py": 45, "store/test_identity.py": 43,
    "model/test_compile.py": 42, "data/test_parquet.py": 40,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (see FILE_SECONDS); a file's tests keep their order."""
    guess: dict[str, float] = {}
    for item in items:
        file = os.path.relpath(item.path, TESTS)
        guess[file] = guess.get(file, 0.0) + (20.0 if item.get_closest_marker("slow") else 0.3)
    cost = {file: FILE_SECONDS.get(file, seconds) for file, seconds in guess.items()}
    items.sort(key=lambda item: -cost[os.path.relpath(item.path, TESTS)])


def make_images(
    root: Path, per_class: int = 6, classes: tuple[str, ...] = ("cats", "dogs"), size: int = 80
) -> list[Path]:
    """Real JPEG and PNG files of random content in an ImageFolder tree."""
    from PIL import Image

    out = []
    rng = np.random.default_rng(1)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = size + int(rng.integers(0, 40)), size + int(rng.integers(0, 40))
            arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            arr = (arr // 32 * 32).astype(np.uint8)  # blocky: compresses, stays non-trivial
            img = Image.fromarray(arr)
            p = root / c / f"{c}{i:02d}.{'jpg' if i % 2 == 0 else 'png'}"
            img.save(p)
            out.append(p)
    return out


# The default model of job(): resnet18's layer names at a sixtieth of its compute (toy_models.TinyResNet).
# A test that compares against torchvision's resnet18 itself, or pins its widths, asks for RESNET18.
TINY_RESNET: dict[str, Any] = {"name": None, "factory": "toy_models:tiny_resnet", "weights": None, "device": "cpu"}
RESNET18: dict[str, Any] = {"name": "resnet18", "weights": None, "device": "cpu"}


def job(root: Path, store: Path, **sections: Any) -> dict[str, Any]:
    """A small job spec as plain data; ``sections`` replace or extend the defaults (a ``model`` that
    names a model, as ``model=RESNET18``, replaces the default toy factory)."""
    raw: dict[str, Any] = {
        "model": dict(TINY_RESNET),
        "data": {"source": "folder", "root": str(root), "resize": 72, "crop": 64,
                 "shard_size": 4, "batch_size": 3, "decode_workers": 2},
        "capture": [
            {"layer": "layer3", "reduce": "none"},
            {"layer": "layer4", "reduce": "mean"},
        ],
        "output": {"store": str(store), "chunk_rows": 2},
        "cluster": {"backend": "local"},
    }
    if isinstance(sections.get("model"), dict) and sections["model"].get("name"):  # a named model, not the toy
        raw["model"] = {k: v for k, v in raw["model"].items() if k != "factory"}
    for k, v in sections.items():
        if isinstance(v, dict) and isinstance(raw.get(k), dict):
            raw[k] = {**raw[k], **v}
        else:
            raw[k] = v
    if raw["model"].get("factory") and isinstance(raw.get("data"), dict):  # toy factories carry no preprocessing
        raw["data"].setdefault("preprocess", "imagenet")
    return raw


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


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with tests/ first on PYTHONPATH (a child then imports ``toy_models``,
    the default model of :func:`job`), and ``extra``."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``extractor ARGS`` run in this process (``cli.main``): its exit code, standard output and error (its log
    lines too) as a subprocess gives them, without a new interpreter importing torch (5-10 s on 2 loaded cores).
    For what a command prints and writes; where the process is the point (signals, Ctrl-C, ``python -m``, a
    cluster's own interpreter) tests start one."""
    from extractor.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)  # the command's log lines, as basicConfig would print them to stderr
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    levels = {name: logging.getLogger(name).level for name in ("extractor", "extractor.progress", "asyncio")}
    hook, here = sys.unraisablehook, os.getcwd()
    logging.getLogger().addHandler(handler)
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as stop:  # argparse: --help, a bad option
                code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    finally:
        os.chdir(here)
        logging.getLogger().removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        sys.unraisablehook = hook
    return subprocess.CompletedProcess(["extractor", *args], code, out.getvalue(), err.getvalue())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mentions(pid: str, text: str) -> bool:
    """Process ``pid``'s command line, working folder or an open file names ``text``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if text in f.read().replace(b"\0", b" ").decode(errors="replace"):
                return True
        links = [f"/proc/{pid}/cwd", *(f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd"))]
    except OSError:
        return False
    for link in links:
        try:
            if text in os.readlink(link):
                return True
        except OSError:
            continue
    return False


def kill_processes_mentioning(text: str) -> list[int]:
    """SIGKILL the processes whose command line, working folder or open files name ``text`` (a temp
    dir this test made). Ray's agents rewrite their command line (and environment), but keep their
    log files in that dir open."""
    import signal

    killed = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and _mentions(entry, text):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except ProcessLookupError:
                pass
    return killed
