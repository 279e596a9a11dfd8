"""A listing made on a thread of the driver while the store is made and its first shards run (issue 57): a source
whose rows can be counted without listing them (Parquet files' footers, a manifest's lines) lists them behind the
job's start instead of before it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Mapping
from typing import Any

import numpy as np

from ..errors import CountError, DataError, ExtractorError, RemakeError
from .rows import Joined, Rows, Texts

__all__ = ["Lister", "Streamed"]

# a source's listing as a generator: for each part (a file) listed, the rows there will be once it is added and how to
# add it to the listing (run under the Streamed's lock: a prefix is never taken while the builders grow); it returns
# the whole listing (its ids checked, its record made)
Lister = Generator[tuple[int, Callable[[], None]], None, Rows]


class Streamed:
    """Rows listed on a thread of their own: their number and classes known first, the rows handed out in row
    order as they are listed (:meth:`upto`: a prefix, an ordinary :class:`Rows` whose rows ``0:stop`` hold, read by
    their row numbers), the whole listing at its end (:meth:`whole`: raises what stopped it: an unreadable file, a
    duplicate id). The store's rows are written from the prefixes (:class:`~extractor.store.RowsBehind`), so the
    first shards start once their rows are listed. Its columns read as a Rows' (``ids``, ``labels``...) wait for
    the whole listing: what needs every row (a resume's comparison) gets them all.

    ``prefix()`` takes the rows added so far (maps of the builders' files: nothing copied), under the lock that
    each part's adding holds: on demand, in the reader's thread, while the lister waits on its next file."""

    def __init__(self, n: int, classes: list[str], lister: Lister, prefix: Callable[[], Rows], *,
                 fingerprinted: bool) -> None:
        self.n, self.classes = n, classes
        self.fingerprinted = fingerprinted  # whether its rows carry fingerprints (``Rows.fingerprints`` not None)
        self.locator_names: tuple[str, ...] = ()  # the locator columns its rows carry (a Parquet source's: none)
        self.stored: dict[str, Any] | None = None  # (as a Rows: these are listed, not left in a store)
        self.listing: dict[str, Any] | None = None  # what it was listed from: known at its end (:meth:`whole`)
        self.listed = 0
        self._take = prefix
        self._prefix: Rows | None = None
        self._rows: Rows | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        # not a daemon: the process ends once the part being listed is read, where its job stopped the listing (a
        # thread left in a reader's native code at the process's exit aborts it: pyarrow's CSV reader). A listing's
        # end (its ids checked for duplicates: seconds at 100M rows) is one part.
        self._thread = threading.Thread(target=self._list, args=(lister,), name="extractor-listing")
        self._thread.start()

    def __len__(self) -> int:
        return self.n

    @property
    def stopping(self) -> bool:
        """Whether its job stopped it (:meth:`stop`): a lister that reads long between two parts asks."""
        return self._stop

    @property
    def done(self) -> bool:
        """Whether the listing ended (listed whole, or stopped by an error)."""
        with self._cond:
            return self._rows is not None or self._error is not None

    def _list(self, lister: Lister) -> None:
        try:
            while True:
                try:
                    listed, add = next(lister)
                except StopIteration as end:
                    rows: Rows = end.value
                    break
                with self._cond:
                    if self._stop:
                        raise DataError("the listing stopped: its job stopped")
                    add()
                    self.listed = listed
                    if listed >= self.n:  # every row: taken now, as the builders are made whole after
                        self._prefix = self._take()
                    self._cond.notify_all()
            if list(rows.classes) != list(self.classes):  # (the store's, and the prefixes' labels, coded by these)
                raise RemakeError(f"the source's classes changed while it was listed: {self.classes[:5]} first, then "
                                  f"{list(rows.classes)[:5]}", "the classes listed first")
            if len(rows) != self.n:
                raise CountError(f"the source changed while it was listed: {self.n} rows counted first, {len(rows)} "
                                "listed; run again")
        except BaseException as err:  # noqa: BLE001 - raised to whoever asks for the rows
            with self._cond:
                self._error = err
                self._cond.notify_all()
            return
        finally:
            lister.close()
        with self._cond:
            self._rows, self.listing = rows, rows.listing
            self._cond.notify_all()

    def upto(self, stop: int) -> Rows:
        """The rows listed so far once there are at least ``stop`` of them (more than there are: the whole listing,
        at its end); raises what stopped the listing."""
        with self._cond:
            while True:
                if self._rows is not None:
                    return self._rows
                self._raise()
                if self._prefix is not None and stop <= self.n and len(self._prefix) >= stop:
                    return self._prefix
                if self.n >= stop <= self.listed:  # listed, not taken yet
                    self._prefix = self._take()
                    assert len(self._prefix) >= stop, f"a prefix of {len(self._prefix)} rows, {self.listed} listed"
                    return self._prefix
                self._cond.wait()

    def whole(self) -> Rows:
        """Every row, once listed (raises what stopped the listing)."""
        return self.upto(self.n + 1)

    def _raise(self) -> None:
        if isinstance(self._error, ExtractorError):
            raise self._error
        if self._error is not None:  # (not a storage error of the store being written: the listing's)
            raise DataError(f"the source could not be listed: {type(self._error).__name__}: {self._error}") \
                from self._error
        if self._stop:
            raise DataError("the listing stopped: its job stopped")

    def stop(self) -> None:
        """Stop listing (after the part being listed); whoever waits for rows is told so."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    # as a Rows: every row, once listed
    @property
    def ids(self) -> Texts | np.ndarray | Joined:
        return self.whole().ids

    @property
    def paths(self) -> Texts | np.ndarray | Joined:
        return self.whole().paths

    @property
    def labels(self) -> np.ndarray:
        return self.whole().labels

    @property
    def fingerprints(self) -> np.ndarray | None:
        return self.whole().fingerprints

    @property
    def locators(self) -> Mapping[str, np.ndarray]:
        return self.whole().locators
