"""Fixtures of the driver's tests (the Ray ones share a set of images slow to process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.images import make_images


@pytest.fixture(scope="module")
def slow_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slow")
    make_images(root, per_class=6, classes=("a", "b"), size=40)
    return root
