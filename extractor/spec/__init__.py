"""The job spec: one YAML file parsed into a frozen, strictly validated tree of models (pydantic)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from .identity import REDACTED, looks_secret, redact, redact_argv, spec_digest
    from .load import apply_overrides, load_spec, parse_model_spec, parse_spec, read_spec
    from .schema import (
        CHECKPOINT_SUFFIXES,
        IMAGE_EXTENSIONS,
        CaptureSpec,
        ClusterSpec,
        DataSpec,
        JobSpec,
        ModelSpec,
        OutputSpec,
        SubmitSpec,
        auto_chunk_rows,
        auto_inner_rows,
        content_of,
        looks_like_path,
        model_folder,
        weights_kind,
    )

__all__ = [
    "JobSpec",
    "ModelSpec",
    "DataSpec",
    "CaptureSpec",
    "OutputSpec",
    "ClusterSpec",
    "SubmitSpec",
    "load_spec",
    "read_spec",
    "parse_spec",
    "parse_model_spec",
    "apply_overrides",
    "content_of",
    "spec_digest",
    "auto_chunk_rows",
    "auto_inner_rows",
    "weights_kind",
    "looks_like_path",
    "model_folder",
    "looks_secret",
    "redact",
    "redact_argv",
    "REDACTED",
    "IMAGE_EXTENSIONS",
    "CHECKPOINT_SUFFIXES",
]

# a name of the face is never a module's name too: the module, once imported, would shadow it
__getattr__ = face(
    __name__,
    {
        "JobSpec": "schema",
        "ModelSpec": "schema",
        "DataSpec": "schema",
        "CaptureSpec": "schema",
        "OutputSpec": "schema",
        "ClusterSpec": "schema",
        "SubmitSpec": "schema",
        "load_spec": "load",
        "read_spec": "load",
        "parse_spec": "load",
        "parse_model_spec": "load",
        "apply_overrides": "load",
        "content_of": "schema",
        "spec_digest": "identity",
        "auto_chunk_rows": "schema",
        "auto_inner_rows": "schema",
        "weights_kind": "schema",
        "looks_like_path": "schema",
        "model_folder": "schema",
        "looks_secret": "identity",
        "redact": "identity",
        "redact_argv": "identity",
        "REDACTED": "identity",
        "IMAGE_EXTENSIONS": "schema",
        "CHECKPOINT_SUFFIXES": "schema",
    },
)
