"""The command line as a user runs it: real processes, exit codes, messages."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import warm
from helpers.images import make_images
from helpers.jobs import job, write_job
from helpers.processes import child_env
from helpers.stores import committed

from extractor.compute.worker import PROBE_FORWARDS
from extractor.read.reader import open_store

TESTS = Path(__file__).resolve().parent


def extractor(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = child_env()
    return warm.run([sys.executable, "-m", "extractor.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)




def slow_job(tmp_path: Path, shard_size: int, chunk_rows: int, reduce: str) -> dict:
    """20 images of 40 px through slow_net (0.15 s per image), one per batch, capturing conv."""
    root = tmp_path / "imgs"
    make_images(root, per_class=10, classes=("a", "b"), size=40)
    return job(root, tmp_path / "s.zarr", model={"name": None, "factory": "toy_models:slow_net", "device": "cpu"},
               data={"resize": None, "crop": 32, "shard_size": shard_size, "batch_size": 1, "decode_workers": 1},
               capture=[{"layer": "conv", "reduce": reduce}],
               output={"store": str(tmp_path / "s.zarr"), "chunk_rows": chunk_rows})


@pytest.mark.slow
def test_run_inspect_and_resume(image_dir: Path, tmp_path: Path):
    spec = write_job(tmp_path / "job.yaml", job(image_dir, tmp_path / "s.zarr"))
    r = extractor("run", str(spec), "--set", "data.batch_size=4", "--set", "submit.env_vars.HF_TOKEN=hf_s3cr3t", "-q")
    assert r.returncode == 0, r.stderr
    assert "12 ok, 0 failed, 0 pending rows; 3 shards run" in r.stdout
    stored = [p for p in (tmp_path / "s.zarr").rglob("*") if p.is_file() and b"hf_s3cr3t" in p.read_bytes()]
    assert not stored, f"a secret reached the store: {stored}"  # neither in the spec nor in the lease's command

    r = extractor("inspect", str(tmp_path / "s.zarr"), "--json")
    info = json.loads(r.stdout)
    assert info["row_status"] == {"pending": 0, "ok": 12, "failed": 0}
    assert info["shards"] == {"total": 3, "done": 3}
    assert info["captures"]["layer3"]["shape"] == [12, 32, 4, 4]  # the default toy (conftest.TINY_RESNET)
    assert info["bytes_on_disk"] is None and info["captures"]["layer3"]["bytes_stored"] is None  # no object listed
    # the values the commits recorded, before compression: 12 rows of each capture's float32 values
    assert info["bytes_committed"] == 12 * 4 * sum(math.prod(c["shape"][1:]) for c in info["captures"].values())
    du = json.loads(extractor("inspect", str(tmp_path / "s.zarr"), "--json", "--du").stdout)
    assert du["bytes_on_disk"] > 0 and all(c["bytes_stored"] > 0 for c in du["captures"].values())
    r = extractor("inspect", str(tmp_path / "s.zarr"))
    assert "layer3" in r.stdout and "12 ok" in r.stdout and "shards 3/3 done" in r.stdout

    r = extractor("run", str(spec), "-q")
    assert r.returncode == 1 and "already exists (3 of 3 shards done" in r.stderr and "--resume" in r.stderr
    r = extractor("run", str(spec), "-q", "--resume")
    assert r.returncode == 0 and "0 shards run, 3 already done" in r.stdout


@pytest.mark.slow
def test_spec_errors_are_one_line_and_write_nothing(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr")
    raw["data"]["batchsize"] = 3
    r = extractor("run", str(write_job(tmp_path / "job.yaml", raw)))
    assert r.returncode == 1
    assert "data.batchsize: unknown key" in r.stderr and "Traceback" not in r.stderr
    r = extractor("run", str(write_job(tmp_path / "job2.yaml", job(image_dir, tmp_path / "s.zarr"))),
                  "--set", "capture[0].layer=layer9")
    assert r.returncode == 1 and "capture[0].layer 'layer9'" in r.stderr and "extractor layers" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.slow
def test_failed_rows_are_listed_and_exit_is_zero(tmp_path: Path):
    root = tmp_path / "imgs"
    make_images(root, per_class=2, classes=("a",))
    (root / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    r = extractor("run", str(write_job(tmp_path / "job.yaml", job(root, tmp_path / "s.zarr"))), "-q")
    assert r.returncode == 0, r.stderr
    assert "2 ok, 1 failed" in r.stdout and "a/broken.jpg" in r.stdout


@pytest.mark.slow
def test_layers_lists_names_shapes_and_parameters():
    r = extractor("layers", "resnet18", "--input-size", "64", "--depth", "1")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("layer4 "))
    assert "Sequential" in line and "1x512x2x2" in line and "8,393,728" in line
    assert "layer4.0" not in r.stdout
    r = extractor("layers", "resnet_18")
    assert r.returncode == 1 and "closest: resnet18" in r.stderr


@pytest.mark.slow
def test_ctrl_c_leaves_a_resumable_store(tmp_path: Path):
    raw = slow_job(tmp_path, shard_size=2, chunk_rows=1, reduce="mean")
    spec = write_job(tmp_path / "job.yaml", raw)
    env = child_env()
    proc = warm.Popen([sys.executable, "-m", "extractor.cli", "run", str(spec), "-q", "--overwrite"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not committed(tmp_path / "s.zarr", 1) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    # the printed command is the one that finishes the job: --resume instead of --overwrite, runnable as pasted
    printed = err.strip().splitlines()[-1].strip()
    assert printed == shlex.join([sys.executable, "-m", "extractor.cli", "run", str(spec), "-q", "--resume"])
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["status"] == "interrupted"
    done = int(s.done_shards.sum())
    assert 2 <= done < 10
    r = subprocess.run(shlex.split(printed), capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"{10 - done} shards run, {done} already done" in r.stdout
    s = open_store(str(tmp_path / "s.zarr"))
    assert (s.status == 1).all() and s.attrs["status"] == "complete"
    assert np.isfinite(s.numpy("conv")).all()


def test_a_signal_once_the_command_is_done_ends_it_with_the_command_s_exit_code(tmp_path: Path):
    """A Ctrl-C that came as the process exited (torch's and Ray's exit callbacks run then) printed a traceback
    ("Exception ignored in atexit callback"), or made a complete job's exit 130 without a word (a helper's audit):
    it ends the process with the command's own exit code now. Here the signal comes from an exit callback."""
    code = ("import atexit, os, signal, sys\n"
            "from extractor.cli import main\n"
            "atexit.register(os.kill, os.getpid(), signal.SIGINT)\n"
            f"sys.argv = ['extractor', 'run', {str(tmp_path / 'none.yaml')!r}]\n"
            "sys.exit(main())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "none.yaml" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


def test_progress_lines_count_the_rate_from_the_first_rows_done(caplog: pytest.LogCaptureFixture):
    """issue 54: `extractor index` said images, and a rate from its start: the warm-up before the first rows (a
    kernel compiled, the lease taken) made a 30-second pass say minutes left. The rate counts from the first rows."""
    import io
    import logging

    from extractor._progress import Progress

    now = [100.0]
    bar = Progress(stream=io.StringIO(), unit="rows", clock=lambda: now[0])
    bar.every = 0
    with caplog.at_level(logging.INFO, logger="extractor.progress"):
        bar.start(6000)
        now[0] += 20  # warm-up: nothing done
        bar.update(200)
        now[0] += 1
        bar.update(1200)  # 1000 rows in the second since the first ones
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["6000 rows to process", "200 of 6000 rows (3%), rate not known yet",
                     "1200 of 6000 rows (20%), 1000.0 rows/s, 00:00:04 left"]  # from the start: 57 rows/s, 84 s


@pytest.mark.slow
def test_preflight_prints_sizes_and_a_time_estimate_from_the_first_batches(tmp_path: Path):
    from extractor.cli.common import Estimate

    est = Estimate(total=1000, batch_size=10)
    assert est.update(10, now=100.0) is None  # the first batch pays for warm-up: not measured
    assert est.update(30, now=101.0) is None  # too few rows yet
    line = est.update(50, now=102.0)  # 40 rows in 2 s after the first batch
    assert line == "estimate: 20.0 images/s after the first 50 images; about 48 s to go for 1000 images"
    assert est.update(60, now=103.0) is None  # said once

    raw = slow_job(tmp_path, shard_size=4, chunk_rows=2, reduce="none")
    r = extractor("run", str(write_job(tmp_path / "job.yaml", raw)))
    assert r.returncode == 0, r.stderr
    assert "20 images to process; 16.0 KiB per row uncompressed (conv 16.0 KiB); store about 320.0 KiB" in r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("estimate:"))
    rate = float(line.split()[1])
    assert 1 < rate < 7.5, line  # slow_net sleeps 0.15 s per batch of one: at most 6.7 images/s


def test_an_interrupted_demo_prints_a_run_command_that_finishes_it(tmp_path: Path, monkeypatch, capsys):
    import extractor.driver.runner
    from extractor.cli import main

    real_run = extractor.driver.runner.run

    def interrupted(spec, **kwargs):  # Ctrl-C as the first shard starts: the store exists, unfinished
        def stop(name: str, info: dict) -> None:
            if name == "shard_started":
                raise KeyboardInterrupt

        return real_run(spec, on_event=stop, **kwargs)

    monkeypatch.setattr(extractor.driver.runner, "run", interrupted)
    base = tmp_path / "demo dir"  # a space: the printed command quotes it
    assert main(["demo", "--dir", str(base), "--per-class", "1", "-q", "--set", "data.crop=32"]) == 130
    printed = capsys.readouterr().err.strip().splitlines()[-1].strip()
    job_yaml = str(base / "job.yaml")
    assert printed == shlex.join([sys.executable, "-m", "extractor.cli", "run", job_yaml, "-q", "--resume"])
    monkeypatch.setattr(extractor.driver.runner, "run", real_run)
    assert main(shlex.split(printed)[3:]) == 0  # what follows "python -m extractor.cli"
    s = open_store(str(base / "demo.zarr"))
    assert (s.status == 1).all() and s["embedding"].shape == (4, 512)


@pytest.mark.slow  # the demo whole: a run, a probe, figures
def test_the_demo_ends_with_the_commands_to_try_next_and_they_run(tmp_path: Path, capsys: pytest.CaptureFixture):
    """issue 54: `make demo` never pointed to `extractor index` and `extractor view`: it ends with them, pasteable."""
    from extractor.cli import main

    base = tmp_path / "demo dir"
    assert main(["demo", "--dir", str(base), "--per-class", "2", "-q", "--set", "data.crop=32",
                 "--set", "data.resize=40"]) == 0
    out = capsys.readouterr().out.splitlines()
    steps = out[out.index("Next, try:") + 1:]
    store = str(base / "demo.zarr")
    prog = [sys.executable, "-m", "extractor.cli"]
    assert [shlex.split(line.split("    # ")[0]) for line in steps] == [[*prog, "index", store, "--key", "layer3"],
                                                                       [*prog, "view", store]]
    assert main([*shlex.split(steps[0].split("    # ")[0])[3:], "-q"]) == 0  # the index it names is made
    assert "index layer3: 256 features of layer3" in capsys.readouterr().out


def test_help_describes_every_command_and_verbose_goes_anywhere():
    from extractor.cli import build_parser, verbosity

    p = build_parser()
    text = p.format_help()
    for command in ("run", "inspect", "layers", "show", "probe", "submit", "jobs", "demo"):
        assert f"extractor {command}" in text
    assert "Only this module prints" not in text
    assert verbosity(p.parse_args(["inspect", "s.zarr", "-v"])) == 1
    assert verbosity(p.parse_args(["-vv", "inspect", "s.zarr"])) == 2
    assert verbosity(p.parse_args(["-v", "inspect", "s.zarr", "-v"])) == 2  # added, not replaced
    assert verbosity(p.parse_args(["inspect", "s.zarr"])) == 0
    with pytest.raises(SystemExit):  # no abbreviations: "--se" is not --set (whose secrets are redacted in logs)
        p.parse_args(["run", "job.yaml", "--se", "data.storage_options.secret=x"])


def test_a_failed_shard_prints_the_command_that_finishes_the_store(tmp_path: Path, capsys):
    """The store is kept after a shard fails; the command printed resumes it (without --overwrite)."""
    from PIL import Image

    from extractor.cli import main

    root = tmp_path / "imgs"
    make_images(root, per_class=4, classes=("a",), size=40)
    for p in sorted((root / "a").iterdir()):  # dark images, PickyNet takes them; but not the last shard's
        Image.new("RGB", (40, 40), (255, 255, 255) if p.name >= "a02" else (20, 30, 40)).save(p)
    raw = job(root, tmp_path / "s.zarr", model={"name": None, "factory": "toy_models:picky_net", "device": "cpu"},
              data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 2},
              capture=[{"layer": "conv", "reduce": "mean"}], output={"store": str(tmp_path / "s.zarr")})
    spec = write_job(tmp_path / "job.yaml", raw)
    assert main(["run", str(spec), "-q", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "shard 1 (rows 2-3) failed" in err and "Once fixed, finish the job with:" in err
    printed = err.strip().splitlines()[-1].strip()
    assert printed.endswith(f"run {spec} -q --resume") and "--overwrite" not in printed
    assert open_store(str(tmp_path / "s.zarr")).done_shards.tolist() == [True, False]


@pytest.mark.slow
def test_a_run_where_every_row_failed_exits_non_zero(tmp_path: Path):
    """Rows that fail are listed and the job goes on, but a store with no usable row is no success."""
    root = tmp_path / "imgs" / "a"
    root.mkdir(parents=True)
    for name in ("x.jpg", "y.jpg"):
        (root / name).write_bytes(b"not a jpeg")
    spec = write_job(tmp_path / "job.yaml", job(tmp_path / "imgs", tmp_path / "s.zarr",
                                                data={"shard_size": 2, "batch_size": 2}))
    r = extractor("run", str(spec), "-q")
    assert r.returncode == 1 and "0 ok, 2 failed" in r.stdout and "every row of" in r.stderr, r.stderr
    assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "complete"


def test_layers_errors_are_one_line(capsys: pytest.CaptureFixture):
    from extractor.cli import main

    assert main(["layers", "--factory", "toy_models"]) == 1
    err = capsys.readouterr().err
    assert "model.factory must look like 'pkg.module:function'" in err and "pydantic" not in err
    assert main(["layers", "resnet18", "--factory", "toy_models:small_cnn"]) == 1
    assert "not both" in capsys.readouterr().err


@pytest.mark.slow
def test_layers_of_a_factory_in_the_current_folder_with_kwargs_and_of_a_job(tmp_path: Path):
    """The console script finds a factory module in the current folder (as `python -m` does), takes
    --kwargs, lists (model) with the name a capture takes, and lists a job's model at the job's size."""
    (tmp_path / "mymodels.py").write_text(
        "from torch import nn\n\n\ndef net(width):\n"
        "    return nn.Sequential(nn.Conv2d(3, width, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())\n")
    script = str(Path(sys.executable).parent / "extractor")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([script, "layers", "--factory", "mymodels:net", "--kwargs", "{width: 5}", "--input-size", "16"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "1x5x14x14" in r.stdout and next(ln for ln in r.stdout.splitlines() if ln.startswith("(model)")).split()[2] \
        == "1x5"
    raw = {"model": {"factory": "mymodels:net", "kwargs": {"width": 7}, "device": "cpu"},
           "data": {"root": str(tmp_path), "resize": 20, "crop": 20, "preprocess": "imagenet"},
           "capture": [{"layer": "(model)", "key": "embedding"}]}
    write_job(tmp_path / "job.yaml", raw)
    r = subprocess.run([script, "layers", "job.yaml"], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "1x7x18x18" in r.stdout and "one 20x20 image" in r.stdout
    r = subprocess.run([script, "layers", "--factory", "mymodels:net"], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    assert r.returncode == 1 and "missing 1 required positional argument: 'width'" in r.stderr


def test_printed_commands_and_debug_logs_carry_no_secret():
    """issue 17, defect 8: the resume command repeated --set secrets verbatim; -vv let botocore's debug
    log print access keys."""
    import logging

    from extractor.cli import main
    from extractor.cli.common import _command

    line = _command("run", "j.yaml", "--set", "output.storage_options.secret=s3cr3t", "--set", "data.batch_size=3")
    assert "s3cr3t" not in line and "***redacted***" in line and "give it again" in line and "batch_size=3" in line
    root, ours = logging.getLogger().level, logging.getLogger("extractor").level
    try:
        logging.getLogger().handlers, handlers = [], logging.getLogger().handlers  # as in a fresh process
        main(["-vv", "inspect", "/nonexistent/store.zarr"])
        assert logging.getLogger("extractor").getEffectiveLevel() == logging.DEBUG
        assert logging.getLogger("botocore").getEffectiveLevel() == logging.INFO
    finally:
        logging.getLogger().handlers = handlers
        logging.getLogger().setLevel(root)
        logging.getLogger("extractor").setLevel(ours)


def test_a_job_submitted_to_a_cluster_prints_the_command_that_finishes_it(image_dir: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture):
    """issue 17, defect 10: a submitted job printed `... run /tmp/ray/.../job.yaml --resume`, a file in Ray's
    temporary folder; submit hands it the command that works (extractor submit ... if_exists=resume)."""
    from extractor.cli import main

    raw = job(image_dir, tmp_path / "s.zarr", model={"name": None, "factory": "toy_models:cuda_fault",
                                                     "kwargs": {"after": PROBE_FORWARDS + 1}, "device": "cpu"},
              data={"preprocess": "imagenet"}, capture=[{"layer": "conv", "reduce": "mean"}])
    spec = write_job(tmp_path / "job.yaml", raw)
    again = "extractor submit job.yaml --address http://head:8265 --set output.if_exists=resume"
    assert main(["run", str(spec), "-q", "--resume-command", again]) == 1
    err = capsys.readouterr().err
    assert f"finish the job with:\n  {again}" in err and "--resume\n" not in err


def test_the_report_gives_the_wall_rate_and_labels_the_workers_compute_rates(image_dir: Path, tmp_path: Path):
    """issue 25, item 11: the report's images/s was the workers' compute rate (97 shown, 10.8 end to end)."""
    from extractor.driver.runner import run
    from extractor.spec.load import parse_spec

    summary = run(parse_spec(job(image_dir, tmp_path / "s.zarr")))
    report = summary.report()
    assert summary.images_per_s == pytest.approx(12 / summary.seconds, rel=1e-6)
    assert f"{summary.images_per_s:.1f} images/s end to end ({summary.compute_images_per_s:.1f} while the shards " \
           "ran)" in report
    assert "compute img/s" in report and summary.compute_images_per_s >= summary.images_per_s


def test_an_error_after_the_store_was_touched_prints_the_command_that_finishes_it(
        image_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """issue 26, defect 13: a Ray worker that kept dying while starting stopped the job with no resume line;
    any error once the store is the job's says how to finish it."""
    from extractor.cli import main
    from extractor.driver.runner import LocalBackend
    from extractor.errors import ClusterError

    def dies(*args: object, **kwargs: object) -> None:
        raise ClusterError("a Ray worker failed to start: RayActorError: it died")

    monkeypatch.setattr(LocalBackend, "run", dies)
    spec = write_job(tmp_path / "job.yaml", job(image_dir, tmp_path / "s.zarr"))
    assert main(["run", str(spec), "-q"]) == 1
    err = capsys.readouterr().err
    assert "error: a Ray worker failed to start: RayActorError: it died\nOnce fixed, finish the job with:" in err
    assert err.strip().endswith(f"run {spec} -q --resume")
    assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "failed"
