"""Running a job: planning, the store's claim and resume, the local and the Ray backends, submitting to a
cluster through the Ray Jobs API. The only layer that imports Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from .dry_run import Preview, preview
    from .environment import check_environment, check_submitted
    from .ray_backend import RayBackend
    from .runner import LocalBackend, RunSummary, run
    from .submit import client, follow_logs

__all__ = [
    "run",
    "RunSummary",
    "LocalBackend",
    "RayBackend",
    "client",
    "follow_logs",
    "check_environment",
    "check_submitted",
    "preview",
    "Preview",
]

# a name of the face is never a module's name too: the module, once imported, would shadow it
__getattr__ = face(
    __name__,
    {
        "run": "runner",
        "RunSummary": "runner",
        "LocalBackend": "runner",
        "RayBackend": "ray_backend",
        "client": "submit",
        "follow_logs": "submit",
        "check_environment": "environment",
        "check_submitted": "environment",
        "preview": "dry_run",
        "Preview": "dry_run",
    },
)
