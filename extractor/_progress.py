"""Rows processed, for people: one reporter for ``extractor run`` and ``extractor.run``.

Where someone watches (a terminal: tqdm; a notebook: tqdm's widget) a bar; elsewhere (a cluster job's
log, a file, a pipe) a line every ``PROGRESS_LOG_S`` seconds, so that ``extractor jobs logs`` shows
how far a job is. Lines beside the bar (the estimate) go through :meth:`Progress.write`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "PROGRESS_LOG_S"]

log = logging.getLogger("extractor")

PROGRESS_LOG_S = 10.0  # without a terminal or a notebook: a progress line this often


class Progress:
    """``start(total)``, ``update(rows done)``, ``write(line)``, ``close()``; nothing at all when not ``enabled``."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.enabled, self.stream = enabled, stream
        self.bar: Any = None
        self.total, self.last = 0, 0.0

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def start(self, total: int) -> None:
        self.total, self.last = total, time.monotonic()
        if not self.enabled:
            return
        if self._out().isatty() or "ipykernel" in sys.modules:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="img", dynamic_ncols=True, file=self._out())
        else:
            log.warning("%d images to process", total)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
        elif self.enabled and time.monotonic() - self.last >= PROGRESS_LOG_S:
            self.last = time.monotonic()
            log.warning("%d of %d images (%.0f%%)", n, self.total, 100 * n / max(self.total, 1))

    def write(self, line: str) -> None:
        """A line beside the bar (above it in a terminal)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=self._out())
        else:
            print(line, file=self._out(), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
