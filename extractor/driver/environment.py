"""What a submitted job runs with, compared on the cluster with what the submitting machine had.

Standard library only: it runs before anything else of a submitted job, so that a cluster
lacking one of extractor's dependencies gets a one-line error naming it, not an ImportError.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from importlib import metadata
from typing import Any

from ..errors import ClusterError

__all__ = ["SUBMITTED", "check_environment", "check_submitted", "environment"]

SUBMITTED = "EXTRACTOR_SUBMITTED_FROM"  # in a submitted job's environment: what the submitting machine had (JSON)
VALUE_PACKAGES = ("torch", "torchvision", "numpy", "pillow")  # another version may change what is computed


CLUSTER_EXTRAS = ("run", "ray")  # what a job on a cluster runs with: the core, and these extras' requirements


def _requirements() -> list[str]:
    """What a job needs of extractor's requirements (``torch>=2.8``, ...), as installed here: the core's and those of
    :data:`CLUSTER_EXTRAS` (without their markers; extractor's own extras left out)."""
    try:
        requires = metadata.requires("extractor") or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return []
    out = []
    for r in requires:
        req, _, marker = (part.strip() for part in r.partition(";"))
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if (not marker or (extra and extra.group(1) in CLUSTER_EXTRAS)) and _dist_name(req) != "extractor":
            out.append(req)
    return out


def _dist_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;(]", requirement, maxsplit=1)[0]


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """What this machine runs extractor with: Python, extractor's requirements and their versions."""
    requires = _requirements()
    return {"python": platform.python_version(), "requires": requires,
            "versions": {_dist_name(r): _installed(_dist_name(r)) for r in requires}}


def check_environment(submitted: dict[str, Any]) -> list[str]:
    """On the cluster, before the job starts: refuse what extractor cannot run with (a missing
    package, one older than extractor needs: a ClusterError naming each, and how to add them), and
    return how Python and the VALUE_PACKAGES differ from the submitting machine ``submitted`` (for a
    warning: another torch can change stored values in the last bits)."""
    missing, old, differs = [], [], []
    for req in submitted.get("requires", []):
        name = _dist_name(req)
        have = _installed(name)
        if have is None:
            missing.append(f"{name}=={submitted['versions'].get(name)}" if submitted["versions"].get(name) else name)
            continue
        if not _satisfies(req, have):
            old.append(f"{name} {have} (extractor needs {req})")
        if name in VALUE_PACKAGES and have != submitted["versions"].get(name):
            differs.append(f"{name} {have} (submitted from {submitted['versions'].get(name)})")
    if any(_dist_name(m).lower() == "ray" for m in missing):
        raise ClusterError(_not_rays(len(missing)))
    if missing or old:
        raise ClusterError(
            f"the cluster's Python ({sys.executable}, {platform.python_version()}) cannot run extractor: "
            + "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                      f"too old: {', '.join(old)}" if old else ""]))
            + ". List them in submit.pip (Ray installs them for the job), or install them in the cluster's image"
        )
    if submitted.get("python", "").split(".")[:2] != platform.python_version().split(".")[:2]:
        differs.insert(0, f"python {platform.python_version()} (submitted from {submitted.get('python')})")
    return differs


def _not_rays(missing: int) -> str:
    """A submitted job whose ``python`` has no ray: the cluster runs Ray (it started this job) with another Python,
    and the job's PATH found this one first. Listing ray in submit.pip would install a second Ray beside it."""
    return (f"the job's python ({sys.executable}) is not the Python the Ray cluster runs: it has no ray (and lacks "
            f"{missing} of extractor's requirements in all), so the job's PATH ({os.environ.get('PATH', '')}) found "
            "another first. Set submit.env_vars.PATH to the cluster's, the folder of its Python first, e.g. --set "
            "submit.env_vars.PATH=/opt/venv/bin:/usr/local/bin:/usr/bin:/bin (on a node, `head -1 $(command -v "
            "ray)` names that Python)")


def _satisfies(requirement: str, version: str) -> bool:
    """``version`` meets ``requirement``'s specifier (True when it cannot be parsed here)."""
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version

        return Requirement(requirement).specifier.contains(Version(version), prereleases=True)
    except Exception:  # noqa: BLE001 - no packaging, or a version string it rejects: nothing to refuse on
        return True


def check_submitted() -> list[str]:
    """In a submitted job (``SUBMITTED`` in its environment): :func:`check_environment`; else nothing."""
    text = os.environ.get(SUBMITTED)
    return check_environment(json.loads(text)) if text else []
