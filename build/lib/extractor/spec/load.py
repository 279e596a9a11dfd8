"""Loading a job spec: one YAML file read (duplicate keys refused), ``--set a.b=value`` overrides applied,
then validated into a :class:`~.schema.JobSpec` (errors name the field path: ``capture[1].reduce: ...``)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import SpecError
from .identity import REDACTED
from .model_spec import ModelSpec
from .schema import JobSpec


def _loc_to_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at ``loc`` (for listing valid keys)."""
    model: Any = JobSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or (ann,)
        model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return None
    return model


def _format_errors(err: ValidationError) -> str:
    lines = []
    errors = err.errors()
    for e in errors:
        loc = tuple(e["loc"])
        if e["type"] == "too_short" and any(tuple(o["loc"])[: len(loc)] == loc and len(o["loc"]) > len(loc)
                                            for o in errors):
            continue  # "capture: at least 1 item" only because its one item is invalid: that item's error says it
        path = _loc_to_path(loc)
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            valid = ", ".join(owner.model_fields) if owner else ""
            lines.append(f"{path}: unknown key (valid keys here: {valid})")
        elif e["type"] == "missing":
            lines.append(f"{path}: required key is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            shown = "" if isinstance(got, (dict, list)) or e["type"] == "value_error" else f" (got {got!r})"
            lines.append(f"{path}: {msg}{shown}")
    return "\n".join(lines)


def _placeholders(d: Any, path: tuple[int | str, ...] = ()) -> list[str]:
    """The field paths of ``d`` whose value is the redaction placeholder: a printed spec or command
    pasted back, where a secret belongs."""
    if isinstance(d, dict):
        return [p for k, v in d.items() for p in _placeholders(v, (*path, k))]
    if isinstance(d, list):
        return [p for i, v in enumerate(d) for p in _placeholders(v, (*path, i))]
    return [_loc_to_path(path)] if d == REDACTED else []


def parse_spec(raw: Any, source: str = "job spec") -> JobSpec:
    """Validate a plain mapping into a :class:`JobSpec`, raising :class:`SpecError`."""
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping with sections model, data, capture, output, cluster")
    secrets = _placeholders(raw)
    if secrets:
        verb = "is" if len(secrets) == 1 else "are"
        raise SpecError(f"{source}: {', '.join(secrets)} {verb} {REDACTED}, which stands for a secret that extractor "
                        "never prints; give its value (--set KEY=VALUE, quoted) or leave it out and give it through "
                        "the environment (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(f"{source} is invalid:\n{_format_errors(err)}") from None


def parse_model_spec(raw: dict[str, Any], source: str) -> ModelSpec:
    """Validate a ``model`` section alone (``extractor layers``), raising :class:`SpecError`."""
    try:
        return ModelSpec.model_validate(raw)
    except ValidationError as err:
        lines = _format_errors(err).replace("(top level): ", "")
        raise SpecError(f"{source}: {lines}" if "\n" not in lines else f"{source}:\n{lines}") from None


_PATH_PART = re.compile(r"([^.\[\]]+)|\[(-?\d+)\]")


def _split_path(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for name, idx in _PATH_PART.findall(path):
        if idx:
            parts.append(int(idx))
        elif name.lstrip("-").isdigit():
            parts.append(int(name))
        else:
            parts.append(name)
    if not parts:
        raise SpecError(f"--set {path!r}: empty key path")
    return parts


def _value(path: str, text: str) -> Any:
    """The value of ``--set PATH=TEXT``: YAML, except an environment variable's (``submit.env_vars.NAME``):
    its text, as typed (an environment holds text; YAML would read ``0022`` as 18)."""
    parts = _split_path(path)
    if len(parts) == 3 and parts[:2] == ["submit", "env_vars"]:
        return text
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as err:
        where = getattr(err, "problem", None) or type(err).__name__
        raise SpecError(f"--set {path}: the value {text!r} is not valid YAML ({where}); quote it, "
                        f"e.g. --set '{path}=[0.5, 0.5, 0.5]'") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` / ``capture[0].reduce=mean`` overrides; values are YAML-parsed, except an environment
    variable's (``submit.env_vars.NAME=0022``): text, as typed."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise SpecError(f"--set {item!r}: expected KEY=VALUE, e.g. data.batch_size=16")
        path, _, text = item.partition("=")
        parts = _split_path(path.strip())
        if text.strip() == REDACTED:  # a printed command pasted back: YAML would read it as an alias
            key = path.strip()
            raise SpecError(f"--set {key}={REDACTED}: {REDACTED} stands for a secret that extractor never prints; give "
                            f"its value (--set '{key}=VALUE') or leave it out and give it through the environment "
                            "(e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
        value = _value(path.strip(), text)
        node: Any = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = _loc_to_path(tuple(parts[: i + 1]))
            if isinstance(part, int):
                parent = _loc_to_path(tuple(parts[:i]))
                if not isinstance(node, list):
                    raise SpecError(f"--set {path}: {parent} is not a list in the spec (a setting left out takes its "
                                    f"default); set the whole list, e.g. --set '{parent}=[...]'")
                if not -len(node) <= part < len(node):
                    raise SpecError(f"--set {path}: {where} does not exist (the list has {len(node)} entries)")
            elif not isinstance(node, dict):
                raise SpecError(f"--set {path}: {_loc_to_path(tuple(parts[:i]))} is not a mapping")
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the second would
    silently replace the first: a whole section's settings lost)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                break  # an unhashable key: the loader below says so
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    f"the key {key!r} first given", seen[key], "is given again (merge the two into one)",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def read_spec(path: str | Path) -> dict[str, Any]:
    """A YAML job spec as plain data (safe loader, a key given twice refused), not yet validated."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"job spec {path} does not exist") from None
    except OSError as err:
        raise SpecError(f"cannot read job spec {path}: {err}") from err
    try:
        loader = _UniqueKeyLoader(text)
        loader.name = str(path)  # error marks name the file
        try:
            raw = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise SpecError(f"{path} is not valid YAML: {err}") from None
    if raw is None:
        raise SpecError(f"{path} is empty; see jobs/demo.yaml for an example job spec")
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping with sections model, data, capture, output, cluster")
    return raw


def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read a YAML job spec (safe loader), apply ``--set`` overrides and validate it."""
    return parse_spec(apply_overrides(read_spec(path), overrides or []), source=str(path))

