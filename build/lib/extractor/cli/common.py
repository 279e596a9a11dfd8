"""What the commands share: the resume command line to print, the duration estimate, a figure saved, argparse
types, a store's options."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from ..errors import ExtractorError


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rem = divmod(seconds, 3600)
    m, sec = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {sec:02d} s" if m else f"{sec} s"


class Estimate:
    """The job's duration, estimated once from the first batches after the first one (which
    pays for warm-up: allocations, cuDNN autotuning, compilation)."""

    def __init__(self, total: int, batch_size: int, min_seconds: float = 1.0) -> None:
        self.total, self.min_rows, self.min_seconds = total, 3 * batch_size, min_seconds
        self.start: tuple[float, int] | None = None
        self.done = False

    def update(self, n: int, now: float) -> str | None:
        """Rows processed so far at time ``now``: the estimate line, the first time it can be made."""
        if self.done:
            return None
        if self.start is None:
            self.start = (now, n)
            return None
        t0, n0 = self.start
        if n - n0 < self.min_rows or now - t0 < self.min_seconds or n >= self.total:
            return None
        self.done = True
        rate = (n - n0) / (now - t0)
        return (f"estimate: {rate:.1f} images/s after the first {n} images; "
                f"about {_duration((self.total - n) / rate)} to go for {self.total} images")


def _command(*args: str) -> str:
    """A command line the user can paste: ``extractor ARGS``, or what ran this one where that is not on PATH.
    Secrets given with ``--set`` are never printed: they are redacted, with a line saying so."""
    import shutil

    from ..spec import REDACTED, redact_argv

    prog = [sys.executable, "-m", "extractor.cli"]  # python -m extractor.cli, or main() called from Python
    if Path(sys.argv[0]).name == "extractor":  # the console script: bare when on PATH, else as typed
        on_path = shutil.which("extractor")
        prog = ["extractor" if on_path and Path(on_path).resolve() == Path(sys.argv[0]).resolve() else sys.argv[0]]
    shown = redact_argv(list(args))
    line = shlex.join([*prog, *shown])
    if shown != list(args):
        line += (f"\n  (each {REDACTED} is a secret you gave with --set: give it again, or through the environment, "
                 "e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
    return line


def _save(fig: Any, out: str | Path) -> None:
    """Write a figure (PNG, PDF or SVG by the extension), creating its folder; a bad path or file type is a
    one-line error."""
    from ..read import save

    save(fig, out)


def _at_least(low: int):  # -> argparse type
    def parse(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n

    parse.__name__ = "int"  # argparse names the type in its "invalid int value" message
    return parse


def _port(text: str) -> int:  # argparse type of --port
    """A port to listen on: 1 to 65535, or 0 for any free one."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535 (0: any free one), not {text}")
    return port


def _store_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` (repeated) as fsspec options: text, except ``true``/``false``
    and plain integers (``0123`` stays text: it may be a secret)."""
    out: dict[str, Any] = {}
    for item in getattr(args, "storage_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ExtractorError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. endpoint_url=http://host:9000")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif value.isdigit() and (value == "0" or not value.startswith("0")):
            out[key] = int(value)
        else:
            out[key] = value
    return out


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ExtractorError(f"{what} takes a feature index or a .npy file of a direction, not {text!r}") from None

