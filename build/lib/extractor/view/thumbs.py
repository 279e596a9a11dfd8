"""Thumbnails of a store's images as the job saw them (decoded from the recorded source, resized and cropped like
the job), made on first use and kept in a bounded cache; a source that is gone is a reason, not an error page."""

from __future__ import annotations

import io
import threading
from collections import OrderedDict

from ..read import ActivationStore, crop_like_job

__all__ = ["SourceGone", "Thumbnails"]

SIZE = 224  # the longer side of a thumbnail, in pixels (a job's crop is usually 224: shown as it is)
CACHED = 1024  # thumbnails kept in memory (about 10 KB each)


class SourceGone(OSError):
    """The image of a row cannot be read from where the store says it is (moved, deleted, unreadable)."""


class Thumbnails:
    """JPEG thumbnails by row: the least recently used forgotten beyond ``cached``, failures remembered with their
    reason (a gone source is not read again on every page)."""

    def __init__(self, store: ActivationStore, size: int = SIZE, cached: int = CACHED) -> None:
        self.store, self.size, self.cached = store, size, cached
        self._made: OrderedDict[int, bytes | SourceGone] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, row: int) -> bytes:
        """The JPEG bytes of row ``row``'s thumbnail (SourceGone saying why when its source cannot be read)."""
        with self._lock:
            made = self._made.get(row)
            if made is not None:
                self._made.move_to_end(row)
        if made is None:
            made = self._make(row)
            with self._lock:
                self._made[row] = made
                while len(self._made) > self.cached:
                    self._made.popitem(last=False)
        if isinstance(made, SourceGone):
            raise made
        return made

    def problem(self, row: int) -> str | None:
        """Why row ``row`` has no thumbnail, or None when it has one (made now if need be)."""
        try:
            self.get(row)
        except SourceGone as gone:
            return str(gone)
        return None

    def _make(self, row: int) -> bytes | SourceGone:
        try:
            img = crop_like_job(self.store.locator(row), self.store)
        except (OSError, ValueError) as err:  # a missing file, a truncated tar, an unreadable image
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err) or type(err).__name__
            return SourceGone(f"its source cannot be read ({why}): {self.store.paths[row]}")
        img.thumbnail((self.size, self.size))
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=85)
        return out.getvalue()
