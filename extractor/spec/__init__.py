"""The job spec: one YAML file parsed into a frozen, strictly validated tree of models (pydantic)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from .schema import (
        CHECKPOINT_SUFFIXES,
        IMAGE_EXTENSIONS,
        REDACTED,
        CaptureSpec,
        ClusterSpec,
        DataSpec,
        JobSpec,
        ModelSpec,
        OutputSpec,
        SubmitSpec,
        apply_overrides,
        auto_chunk_rows,
        auto_inner_rows,
        content_of,
        load_spec,
        looks_like_path,
        looks_secret,
        model_folder,
        parse_model_spec,
        parse_spec,
        read_spec,
        redact,
        redact_argv,
        spec_digest,
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
        "load_spec": "schema",
        "read_spec": "schema",
        "parse_spec": "schema",
        "parse_model_spec": "schema",
        "apply_overrides": "schema",
        "content_of": "schema",
        "spec_digest": "schema",
        "auto_chunk_rows": "schema",
        "auto_inner_rows": "schema",
        "weights_kind": "schema",
        "looks_like_path": "schema",
        "model_folder": "schema",
        "looks_secret": "schema",
        "redact": "schema",
        "redact_argv": "schema",
        "REDACTED": "schema",
        "IMAGE_EXTENSIONS": "schema",
        "CHECKPOINT_SUFFIXES": "schema",
    },
)
