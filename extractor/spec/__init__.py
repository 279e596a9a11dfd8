"""The job spec: one YAML file parsed into a frozen, strictly validated tree of models (pydantic)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .capture_spec import CaptureSpec, index_name_problem
    from .data_spec import DataSpec
    from .identity import REDACTED, looks_secret, redact, redact_argv, spec_digest
    from .load import apply_overrides, load_spec, parse_model_spec, parse_spec, read_spec
    from .model_spec import ModelSpec, weights_kind
    from .schema import ClusterSpec, JobSpec, auto_chunk_rows, auto_inner_rows, content_of
    from .sources import PLACES, SOURCE_ONLY, SOURCE_SETTINGS, SourceSettings

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
