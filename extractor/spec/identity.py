"""What identifies a job's store and what a spec may show: the field markers (run-only, resolved), the spec's
digest, and the redaction of secrets (storage options, credential-like environment variables)."""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

import yaml


class _Spec(Protocol):
    """A job spec as its digest reads it (``schema.JobSpec``, which imports this module)."""

    def content_dict(self) -> dict[str, Any]: ...


# Field markers (json_schema_extra). Run-only: changes how a job runs, not what it computes (beyond float rounding:
# another device or batch size may sum in another order), so a store may be resumed with it changed.
# model.channels_last is not one: it changes stored values by about one float16 ulp, so a resumed store would
# mix both. Resolved: a preprocessing setting, compared through the resolved record instead of as written.
RUN_ONLY: dict[str, Any] = {"run_only": True}
RESOLVED: dict[str, Any] = {"resolved": "preprocess"}


# storage-option keys whose values are not secret; every other value is redacted
_PUBLIC_OPTIONS = {"endpoint_url", "region_name", "region", "anon", "use_ssl", "requester_pays", "profile",
                   "project", "default_block_size", "default_fill_cache", "client_kwargs", "config_kwargs",
                   "s3_additional_kwargs", "version_aware", "asynchronous", "skip_instance_cache"}
REDACTED = "***redacted***"


# environment variables: a name holding one of these looks like a credential's
_SECRET_NAME_PARTS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE", "SIGNATURE", "COOKIE", "AUTH",
                      "SESSION", "APIKEY", "ACCESS_KEY")
_SECRET_NAME_WORDS = {"KEY", "PASS", "PW", "PAT", "DSN", "CERT"}  # ... or one of these words (split at _ - .)
# a value that is a key, a URL with a password, a known token's prefix or a long hex string
_SECRET_VALUE = re.compile(r"-----BEGIN|://[^/\s:@]+:[^/\s@]+@|^(AKIA|ASIA)[A-Z0-9]{16}$|"
                           r"^(ghp_|gho_|ghs_|github_pat_|hf_|sk-|xox[abpr]-|glpat-)|^[0-9a-fA-F]{32,}$")
_URL_PASSWORD = re.compile(r"(://[^/\s:@]+:)[^/\s@]+(@)")  # scheme://user:PASSWORD@host
_SECRET_FLAG_PARTS = tuple(part.replace("_", "") for part in _SECRET_NAME_PARTS)  # in a flag's letters (--api-key)


def looks_secret(name: str, value: Any) -> bool:
    """An environment variable (``submit.env_vars``) that looks like a credential, by its name (``HF_TOKEN``,
    ``AWS_SECRET_ACCESS_KEY``, ``PGPASSWORD``, ``API_KEY``) or its value (``AKIA...``, ``hf_...``, a private key,
    ``https://user:pass@host``, a long random-looking word: 20 characters or more, no spaces, upper and lower case
    letters and digits). ``PATH``, ``OMP_NUM_THREADS: "4"`` or ``EXTRACTOR_PROGRESS_S: "60"`` are not."""
    upper = name.upper()
    if any(part in upper for part in _SECRET_NAME_PARTS) or _SECRET_NAME_WORDS & set(re.split(r"[_.\-]", upper)):
        return True
    text = str(value)
    if _SECRET_VALUE.search(text):
        return True
    classes = sum(bool(re.search(c, text)) for c in ("[a-z]", "[A-Z]", "[0-9]"))
    return len(text) >= 20 and not re.search(r"\s", text) and classes == 3


def redact(d: Any, inside_options: bool = False) -> Any:
    """A copy of ``d`` with every non-public value under a ``storage_options`` key, every
    value under ``env_vars`` (the job's environment on the cluster) that looks like a credential
    (:func:`looks_secret`), and every URL's password (``https://user:***@host``), redacted: the one rule for
    every record a command writes (the store's record, a claimant's, an index's)."""
    if isinstance(d, dict):
        return {k: _redact_item(k, v, inside_options) for k, v in d.items()}
    if isinstance(d, list):
        return [redact(v, inside_options) for v in d]
    if isinstance(d, str) and "@" in d:
        return _URL_PASSWORD.sub(rf"\g<1>{REDACTED}\g<2>", d)
    return d


def _redact_item(k: Any, v: Any, inside_options: bool) -> Any:
    """The value ``v`` of key ``k`` of a record, redacted (``inside_options``: under a ``storage_options`` key)."""
    if inside_options and k not in _PUBLIC_OPTIONS:
        return REDACTED
    if inside_options and isinstance(v, dict):  # client_kwargs, config_kwargs: options of their own
        return redact(v, True)
    if k == "env_vars" and isinstance(v, dict):
        return {name: REDACTED if looks_secret(str(name), value) else value for name, value in v.items()}
    return redact(v, inside_options or k == "storage_options")


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with its secrets redacted: the one rule for every command line a record, a log or a printed
    line keeps (a claimant's record keeps the command that runs, ``sys.argv``, whatever program it is). Redacted:
    a ``--set KEY=VALUE`` override whose spec :func:`redact` would redact; a ``--storage-option KEY=VALUE`` whose
    key is not a public option (``endpoint_url``, ``region_name`` stay); the value of a flag whose name is a
    credential's (``--token``, ``--aws-secret-access-key``, ``--password=...``); a value that is one by its look
    (``AKIA...``, ``hf_...``, a private key, a long hex string); a URL's password (``https://user:***@host``)."""
    out: list[str] = []
    for k, arg in enumerate(argv):
        flag, value = (arg.split("=", 1)) if arg.startswith("--") and "=" in arg else ("", arg)
        if not flag and k and argv[k - 1].startswith("--") and "=" not in argv[k - 1] and not arg.startswith("-"):
            flag = argv[k - 1]  # --flag VALUE
        redacted = _redact_value(flag, value)
        out.append(f"{arg.split('=', 1)[0]}={redacted}" if arg.startswith("--") and "=" in arg else redacted)
    return out


def _redact_value(flag: str, value: str) -> str:
    """``value`` as given after ``flag`` ("" for none), redacted by :func:`redact_argv`'s rule."""
    if flag in ("--set", "--storage-option") and "=" in value:
        key, given = value.split("=", 1)
        if flag == "--storage-option":
            return value if key in _PUBLIC_OPTIONS else f"{key}={REDACTED}"
        try:
            parsed = yaml.safe_load(given)
        except yaml.YAMLError:
            parsed = given
        nested: Any = parsed
        for part in reversed(key.split(".")):  # the override as the spec it makes: redacted as the spec is
            nested = {part: nested}
        return f"{key}={REDACTED if redact(nested) != nested else given}"
    letters = re.sub(r"[^A-Z]", "", flag.upper())  # --aws-secret-access-key: AWSSECRETACCESSKEY
    if value and any(part in letters for part in _SECRET_FLAG_PARTS):
        return REDACTED
    if _URL_PASSWORD.search(value):
        return str(redact(value))
    return REDACTED if _SECRET_VALUE.search(value) else value


def _marked(info: Any) -> bool:
    """A field that is run-only or compared through what it resolves to (not as written)."""
    extra = info.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("run_only") or extra.get("resolved"))


def spec_digest(spec: _Spec) -> str:
    """A short stable hash of what decides the store's contents."""
    import hashlib

    blob = json.dumps(spec.content_dict(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

