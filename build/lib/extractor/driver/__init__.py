"""Running a job: planning, the store's claim and resume, the local and the Ray backends, submitting to a
cluster through the Ray Jobs API. The only layer that imports Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .dry_run import preview
    from .environment import check_environment, check_submitted
    from .ray_backend import RayBackend
    from .runner import LocalBackend, RunSummary, run
    from .submit import client, follow_logs
    from .submit import submit as submit_job

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
