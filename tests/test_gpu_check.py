"""bench/gpu_check.py's device check (gpu_speed) runs its small version on the CPU: the same jobs, bare loops and
decode comparison as on a GPU, on tiny models, so that the script a lent GPU runs keeps working."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_device_check_runs_small_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))  # gpu_check's files, and the ViT cases' model.factory gpu_speed:vit
    import gpu_speed

    got = gpu_speed.main(tmp_path, "cpu")
    out = capsys.readouterr().out
    cases = gpu_speed.cases(small=True)
    assert got["small"] and set(got["cases"]) == {c.name for c in cases}
    for case in cases:
        row = got["cases"][case.name]
        assert row["bare_forward"] > 0 and row["bare_jpeg"] > 0
        job = row["extractor_cpu"]
        assert job["ok"] == case.images and job["failed"] == 0 and job["images_per_s"] > 0 and job["gb_per_s"] > 0
        assert case.name in out
    assert got["pixels"]["failed"] == 0 and got["pixels"]["max"] <= 3  # torchvision's CPU decoder against Pillow
    assert "DALI: not run (no CUDA)" in out and "Targets (issue 55)" in out
