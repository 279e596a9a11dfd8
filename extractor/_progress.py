"""Rows processed, for people: one reporter for ``extractor run``, ``extractor.run`` and ``extractor index``.

Where someone watches (a terminal: tqdm; a notebook: tqdm's widget) a bar; elsewhere (a cluster job's
log, a file, a pipe) a line every ``PROGRESS_LOG_S`` seconds, so that ``extractor jobs logs`` shows
how far a job is. Lines beside the bar (the estimate) go through :meth:`Progress.write`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["PROGRESS_LOG_S", "Progress"]

log = logging.getLogger("extractor.progress")  # INFO lines: `extractor run` shows them; a script configures logging

PROGRESS_LOG_S = 10.0  # without a terminal or a notebook: a progress line this often (EXTRACTOR_PROGRESS_S sets it)


class Progress:
    """``start(total)``, ``update(done)``, ``write(line)``, ``close()``; nothing at all when not ``enabled``.
    ``unit``: what is counted (``images``; ``rows`` for a pass over a store).

    The rate is measured from the first update on, never from ``start``: what comes before the first rows are done
    (a model loaded, kernels compiled, a lease taken) is warm-up, and counted in it made a 30-second pass say
    minutes left."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, unit: str = "images",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled, self.stream, self.unit, self.clock = enabled, stream, unit, clock
        self.bar: Any = None
        self.total, self.last, self.began = 0, 0.0, 0.0
        self.first: tuple[float, int] | None = None  # (time, done) at the first update: where the rate counts from
        self.every = float(os.environ.get("EXTRACTOR_PROGRESS_S", PROGRESS_LOG_S))

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def start(self, total: int) -> None:
        self.total, self.last = total, self.clock()
        self.began, self.first = self.last, None
        if not self.enabled:
            return
        if self._out().isatty() or "ipykernel" in sys.modules:
            from tqdm.auto import tqdm

            short = {"images": "img"}.get(self.unit, self.unit.removesuffix("s"))
            self.bar = tqdm(total=total, unit=short, dynamic_ncols=True, file=self._out())
        else:
            log.info("%d %s to process", total, self.unit)

    def update(self, n: int) -> None:
        if self.first is None:
            self._first(n)
        elif self.bar is not None:
            self.bar.update(n - self.bar.n)
        if self.bar is None and self.enabled and self.clock() - self.last >= self.every:
            self.last = self.clock()
            log.info("%s", self.line(n))

    def _first(self, n: int) -> None:
        """The first rows are done: the rate counts from here; the bar shows them done at once, its clock reset."""
        self.first = (self.clock(), n)
        if self.bar is not None:
            self.bar.reset(total=self.total)
            self.bar.initial = self.bar.n = self.bar.last_print_n = n  # tqdm's rate: (n - initial) / elapsed
            self.bar.refresh()

    def line(self, n: int) -> str:
        """``n`` of the total done, the rate since the first update, and the time left at that rate."""
        done = f"{n} of {self.total} {self.unit} ({100 * n / max(self.total, 1):.0f}%)"
        t0, n0 = self.first if self.first is not None else (self.clock(), n)
        elapsed = self.clock() - t0
        if n <= n0 or elapsed <= 0:
            return f"{done}, rate not known yet"
        rate = (n - n0) / elapsed
        left = (self.total - n) / rate
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left < 86400 else f"{left / 86400:.1f} days"
        return f"{done}, {rate:.1f} {self.unit}/s, {eta} left"

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
