"""Rows processed, for people: one reporter for ``extractor run`` and ``extractor.run``.

Where someone watches (a terminal: tqdm; a notebook: tqdm's widget) a bar; elsewhere (a cluster job's
log, a file, a pipe) a line every ``PROGRESS_LOG_S`` seconds, so that ``extractor jobs logs`` shows
how far a job is. Lines beside the bar (the estimate) go through :meth:`Progress.write`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "PROGRESS_LOG_S"]

log = logging.getLogger("extractor.progress")  # INFO lines: `extractor run` shows them; a script configures logging

PROGRESS_LOG_S = 10.0  # without a terminal or a notebook: a progress line this often (EXTRACTOR_PROGRESS_S sets it)


class Progress:
    """``start(total)``, ``update(rows done)``, ``write(line)``, ``close()``; nothing at all when not ``enabled``."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.enabled, self.stream = enabled, stream
        self.bar: Any = None
        self.total, self.last, self.began = 0, 0.0, 0.0
        self.every = float(os.environ.get("EXTRACTOR_PROGRESS_S", PROGRESS_LOG_S))

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def start(self, total: int) -> None:
        self.total, self.last = total, time.monotonic()
        self.began = self.last
        if not self.enabled:
            return
        if self._out().isatty() or "ipykernel" in sys.modules:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="img", dynamic_ncols=True, file=self._out())
        else:
            log.info("%d images to process", total)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
        elif self.enabled and time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            log.info("%s", self.line(n))

    def line(self, n: int) -> str:
        """``n`` of the total images done, the rate since the start, and the time left at that rate."""
        rate = n / max(time.monotonic() - self.began, 1e-9)
        left = (self.total - n) / rate if rate > 0 else float("inf")
        eta = "?" if left == float("inf") else time.strftime("%H:%M:%S", time.gmtime(left)) if left < 86400 \
            else f"{left / 86400:.1f} days"
        return f"{n} of {self.total} images ({100 * n / max(self.total, 1):.0f}%), {rate:.1f} images/s, {eta} left"

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
