"""The manifest source (``data.manifest``): a CSV or JSON-lines file of rows (path or URL, id, label)."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import itertools
import json
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from ...errors import CountError, DataError, RemakeError
from ..files import (
    absolute,
    is_relative,
    is_url,
    leaves_root,
    remote_error,
)
from ..rows import (
    ClassCodes,
    Distinct,
    Joined,
    Joining,
    Rows,
    Strings,
    duplicate,
    first_name,
    label_number,
    labels_of,
    labels_of_codes,
    late_name,
    missing_label,
    whole_number,
)
from ..spill import Column
from ..streamed import Lister, Streamed
from . import Sampled, Source

if TYPE_CHECKING:
    from ...spec import DataSpec


PART_BYTES = 1 << 20  # a part of a manifest, sampled by ``extractor plan`` (Source.sample)


def _base(manifest: str, root: str | None) -> str:
    """Where a manifest's relative paths lie: data.root, or the manifest's folder."""
    return root if root is not None else (manifest.rsplit("/", 1)[0] if "/" in manifest else ".")


def _made(head: str) -> str:
    """The head of a manifest's relative paths (its base, a trailing "/"), as absolute() makes their whole paths."""
    return head if is_url(head) else os.path.join(absolute(head), "")


def _list_manifest(manifest: str, root: str | None, storage: dict, outside_root: bool = False,
                   columns: dict[str, str] | None = None, stopped: Callable[[], bool] | None = None) -> Rows:
    """A manifest's rows: read in bulk by pyarrow where it can (:func:`_arrow_bulk`), else row by row. ``stopped``:
    asked now and then, row by row (a listing streamed whose job stopped: :func:`_stream_manifest`; it is the
    row-by-row reader's turn then)."""
    base = _base(manifest, root)
    names = _Columns(manifest, columns or {})
    head = base.rstrip("/") + "/"
    fast = _arrow_bulk(manifest, storage, _made(head), names, outside_root) if stopped is None else None
    if fast is not None:
        return _checked(manifest, fast, lambda n: f"{manifest} row {n + 1}")
    ids = Strings()
    paths = Joining([_made(head)], ids)

    def labels() -> Iterator[Any]:
        for n, rec in enumerate(_manifest_records(manifest, storage)):
            if stopped is not None and not n % STOP_ROWS and stopped():
                raise DataError("the listing stopped: its job stopped")
            p = names.image_of(rec, n)
            if "\0" in p:
                raise DataError(f"{manifest} row {n + 1}: path {p!r} holds a NUL byte, which no file name does; fix "
                                "the row")
            if not outside_root and leaves_root(p):
                raise DataError(f"{manifest} row {n + 1}: path {p!r} lies outside data.root ({base}); a manifest "
                                "names images under its root, by relative paths that stay inside it. If its paths are "
                                "absolute, URLs or lead elsewhere by design, set data.outside_root: true")
            full = absolute(f"{head}{p}" if is_relative(p) else p)
            given = names.scalar(rec, names.id, n)
            ids.append(str(given) if given not in (None, "") else p)
            paths.whole(full)
            yield names.scalar(rec, names.label, n)

    codes, classes = labels_of(labels(), lambda n: f"{manifest} row {n + 1}")
    names.check_seen()
    listed = ids.array()
    return _checked(manifest, Rows(ids=listed, paths=paths.joined(listed), labels=codes, classes=classes), None)


STOP_ROWS = 65_536  # rows a listing streamed reads between two looks at whether its job stopped


def _stream_manifest(manifest: str, root: str | None, storage: dict, outside_root: bool, columns: dict[str, str],
                     classes: list[str] | None, record: Callable[[], dict[str, Any] | None],
                     then: Callable[[Rows], Rows]) -> Streamed | None:
    """The rows of :func:`_list_manifest`, listed on a thread (:class:`~..streamed.Streamed`) once they are counted:
    a CSV or JSON-lines manifest read by pyarrow whose rows are its lines (:func:`_lines`), its labels known as
    they are read (none, or :class:`_ArrowCodes`: data.classes, ``classes``, names them; class indices without
    it). None otherwise. A block the bulk reader
    leaves to the row-by-row reader has the file listed row by row from its start (the rows handed out before are
    the same rows). ``record``: the manifest's listing record (a read of the whole file: made once it streams,
    before its rows are read); ``then``: made of the whole listing."""
    names = _Columns(manifest, columns)
    if not _bulk_reads(manifest) or not ClassCodes.usable(classes):
        return None  # (data.classes with a name that reads as a number: its labels are known once all are read)
    n = _lines(manifest, storage, names)
    if not n:
        return None
    base = _made(_base(manifest, root).rstrip("/") + "/")
    taken = _first_taken(manifest, storage, _Bulk(base, names, outside_root, _ArrowCodes(manifest, classes)))
    found: list[str] | None = []  # (none: the labels taken as the first block has them)
    if _names_read_first(manifest, storage, names, taken):
        found = _label_names(manifest, storage, names)
    if taken == "whole" or found is None or (taken == "names" and not found):
        return None
    bulk = _Bulk(base, names, outside_root, _ArrowCodes(manifest, found or classes, bool(found)))
    listing = record()
    made: list[Streamed] = []

    def stopped() -> bool:
        return bool(made) and made[0].stopping

    def lister() -> Lister:
        listed = 0
        with _blocks(manifest, storage, names) as blocks:
            for block in blocks:
                taken = None if block is None else bulk.prepare(*block)
                if taken is None:
                    break
                listed += taken.rows  # (counted here: the builders are read under the lock only)
                yield listed, functools.partial(bulk.add, taken)
            else:
                if listed != n and _json(manifest):
                    raise CountError(f"{manifest}: {n} lines, but {listed} rows read from them: a line holds more "
                                     "than one object, or an object spans lines (or the file changed while it was "
                                     "read); write one object a line")
                return then(replace(_bulk_listed(manifest, bulk, found), listing=listing))
        rows = _list_manifest(manifest, root, storage, outside_root, columns, stopped)
        return then(replace(_row_by_row_listed(manifest, rows, bulk, found), listing=listing))

    made.append(Streamed(n, list(found or classes or []), lister(), bulk.prefix, fingerprinted=False))
    return made[0]


def _bulk_listed(manifest: str, bulk: _Bulk, found: list[str]) -> Rows:
    """The rows of a manifest streamed, every block read in bulk (``found``: the class names read first, if any);
    refused where one of those names is no row's label now (the indices of the names after it are the listing's,
    less one)."""
    rows = bulk.rows(lambda n: f"{manifest} row {n + 1}")
    gone = bulk.codes.unread() if found and bulk.codes is not None else []
    if gone:
        raise _changed(manifest, f"no row's label is {gone[0]!r} now")
    return _checked(manifest, replace(rows, classes=found or rows.classes), None)


def _row_by_row_listed(manifest: str, rows: Rows, bulk: _Bulk, found: list[str]) -> Rows:
    """``rows``, a manifest streamed and then read row by row from its start (a block the bulk reader left),
    refused where their labels are not what the prefixes handed out took them for: class indices (a name read:
    ``found`` empty and data.classes not given), or indices into the names read first (``found``)."""
    if bulk.codes is not None and bulk.codes.codes.classes is None and rows.classes:
        raise _first_name(manifest, rows)
    if found and rows.classes != found:
        raise _changed(manifest, f"its labels name {len(rows.classes)} classes, {len(found)} when they were read "
                                 "first")
    return rows


def _changed(manifest: str, what: str) -> RemakeError:
    """The error of a manifest whose class names, read first (:func:`_label_names`), are not those of its labels as
    they are listed: it changed meanwhile (``what``: how)."""
    return RemakeError(f"{manifest} changed while it was listed ({what}); run again", "the class names its labels "
                       "had when they were read first")


def _names_read_first(manifest: str, storage: dict, names: _Columns, taken: str) -> bool:
    """Whether what a manifest's labels are is read first (:func:`_label_names`), its first block ``taken`` so
    (:func:`_first_taken`, data.classes not given): it holds a name, or no label where a CSV's header names the
    label column."""
    return taken == "names" or (taken == "unlabeled" and _label_column(manifest, storage, names))


def _label_column(manifest: str, storage: dict, names: _Columns) -> bool:
    """Whether a CSV manifest's header names its label column (JSON lines have no header: False; a label first read
    after their first block is taken as a class index)."""
    if _json(manifest):
        return False
    with _opened(manifest, storage) as f:
        first = f.read(1 << 20)
    header = _header(first[:first.find(b"\n") + 1])
    return header is not None and names.label in header


def _first_name(manifest: str, rows: Rows) -> DataError:
    """The error of a streamed listing of class indices whose rows, read row by row, hold a class name: the first
    name, named by its row (the listing made whole numbers every label as a name then, indices included)."""
    first = first_name(rows)
    assert first is not None
    return late_name(f"{manifest} row {first[0] + 1}: label {rows.classes[int(rows.labels[first[0]])]!r} is a class "
                     "name")


class _ArrowCodes:
    """A manifest's labels (an Arrow array a block at a time: texts, or a JSON-lines manifest's numbers) made class
    indices as they are read (:class:`~..rows.ClassCodes`): where data.classes names them (none of its names reads
    as a number); or, without data.classes, where every label is a class index (a name stops the listing, saying
    to name the classes; in the first block, it is listed whole instead, which numbers the names)."""

    def __init__(self, manifest: str, classes: list[str] | None, found: bool = False) -> None:
        self.codes = ClassCodes(classes, lambda n: f"{manifest} row {n + 1}")
        self.manifest = manifest
        self.found = found  # the classes are the labels' own names, read first (:func:`_label_names`)
        self.known: dict[object, int] = {"": -1}  # each label read so far: its class index
        self.rows = 0  # rows coded so far

    def coded(self, label: Any) -> np.ndarray:
        """A block's labels (nulls: none) as class indices (int64; -1: none)."""
        encoded = label.dictionary_encode()
        values: list[object] = encoded.dictionary.to_pylist()
        at = encoded.indices.fill_null(len(values)).to_numpy(zero_copy_only=False)
        new = [k for k, v in enumerate(values) if v not in self.known]
        if new:
            value_at, first_at = np.unique(at, return_index=True)
            firsts = dict(zip(value_at.tolist(), (self.rows + first_at).tolist(), strict=True))
            odd = [k for k in new if self.found and not missing_label(values[k]) and
                   str(values[k]) not in self.codes.names]
            if odd:  # (a name, or a number, that no label was when they were read first)
                raise _changed(self.manifest, f"{self.codes.where(firsts[odd[0]])}: label {values[odd[0]]!r} was not "
                                              "there when the labels were read first")
            table = self.codes.table([values[k] for k in new], [firsts[k] for k in new])
            self.known.update(zip([values[k] for k in new], table.tolist(), strict=True))
        self.rows += len(at)
        return np.append(np.asarray([self.known[v] for v in values], dtype=np.int64), -1)[at]

    def unread(self) -> list[str]:
        """The names of data.classes (or read first) that no label read so far is."""
        read = {str(v) for v in self.known if not missing_label(v)}
        return [c for c in self.codes.names if c not in read]


def _first_taken(manifest: str, storage: dict, bulk: _Bulk) -> str:
    """Whether the bulk reader takes a manifest's first block, "bulk" (else "whole": it is listed whole, which
    refuses what is wrong there before a store is made); its labels coded, a label refused there refused now,
    naming its row. data.classes not given: "names" where it holds a class name, "unlabeled" where it holds no
    label (what the labels are is read first then: :func:`_label_names`)."""
    with _blocks(manifest, storage, bulk.names) as blocks:
        first = next(blocks, None)
        if first is None or bulk.check(*first) is None:
            return "whole"
        if bulk.codes is None:
            return "bulk"
        try:
            coded = bulk.codes.coded(first[2])
        except DataError:
            if bulk.codes.codes.classes is None:
                return "names"
            raise
        return "unlabeled" if bulk.codes.codes.classes is None and not (coded >= 0).any() else "bulk"


NAMES_MOST = 1 << 16  # distinct labels a manifest's first read of them keeps (:func:`_label_names`)


def _label_names(manifest: str, storage: dict, names: _Columns) -> list[str] | None:
    """The class names of a manifest whose labels are names, data.classes not given, numbered as a listing made
    whole numbers them (sorted), from a read of its label column alone before its rows are listed (a CSV's other
    columns not made: 0.1-0.2 s of CPU a million rows): its rows then stream as if data.classes named them. [] where
    no label is a name (none, or class indices: taken as they come); None (listed whole) where names and numbers
    both are (the listing made whole decides what the numbers are), a block is not read in bulk, or there are more
    than :data:`NAMES_MOST` distinct labels."""
    seen: set[object] = set()
    with _blocks(manifest, storage, names, labels_only=True) as blocks:
        for block in blocks:
            if block is None:
                return None
            seen.update(block[2].dictionary_encode().dictionary.to_pylist())  # (nulls: not in the dictionary)
            seen.discard("")
            if len(seen) > NAMES_MOST:
                return None
    present = [v for v in seen if not missing_label(v)]
    numbers = [label_number(v) for v in present]
    if all(d is not None and whole_number(d) for d in numbers):
        return []
    return None if any(d is not None for d in numbers) else sorted({str(v) for v in present})


def _bulk_reads(manifest: str) -> bool:
    """Whether pyarrow may read the manifest in bulk (:func:`_arrow_bulk`): installed, a CSV or JSON lines, a URL
    or a file."""
    try:
        import pyarrow.csv  # noqa: F401
    except ImportError:
        return False
    return _suffix(manifest) in (".csv", *JSON_LINES) and (is_url(manifest) or os.path.isfile(manifest))


JSON_LINES = (".jsonl", ".ndjson")


def _json(manifest: str) -> bool:
    return _suffix(manifest) in JSON_LINES


def _lines(manifest: str, storage: dict, names: _Columns) -> int | None:
    """The rows of a CSV manifest counted from its line breaks after its header (:func:`_csv_rows`: those outside
    quoted values, blank lines left out), of JSON lines as its lines with more than white space
    (:func:`_json_counted`); in a CSV, every column data.columns names in its header. None where they cannot be
    counted so. A read of the file at the speed of the disk or the network: no row parsed."""
    try:
        with _opened(manifest, storage) as f:
            first = f.read(1 << 20)
            if _json(manifest):  # (no header; a line holds no line break: JSON writes one in a text as \n)
                return _json_counted(itertools.chain([first], iter(lambda: f.read(16 << 20), b"")))
            end = first.find(b"\n") + 1
            header = _header(first[:end])
            if header is None or names.image not in header or any(c not in header for c in names.mapped):
                return None
            return _csv_rows(itertools.chain([first[end:]], iter(lambda: f.read(16 << 20), b"")))
    except Exception as err:
        if is_url(manifest) and not isinstance(err, DataError):  # its storage failed as it was read
            raise remote_error("data.manifest", manifest, err) from err
        raise


def _header(line: bytes) -> list[str] | None:
    """A CSV manifest's column names from its first line, where pyarrow and Python's csv read them alike: a whole
    line (its end ``\\n`` or ``\\r\\n``), no quote but around a whole name, no other carriage return, no name twice
    (pyarrow takes the first such column, Python's csv the last). None otherwise."""
    line = line[:-2] + b"\n" if line.endswith(b"\r\n") else line
    if not line.endswith(b"\n") or b"\r" in line:
        return None
    names = line[:-1].decode("utf-8-sig", errors="replace").split(",")
    if any('"' in n for n in names):  # (a name quoted whole, holding no quote: R's and QUOTE_ALL's)
        if not all('"' not in n or (len(n) >= 2 and n[0] == n[-1] == '"' and '"' not in n[1:-1]) for n in names):
            return None
        names = [n[1:-1] if n[:1] == '"' else n for n in names]
    return names if len(set(names)) == len(names) else None


def _named_twice(manifest: str, storage: dict) -> bool:
    """Whether a CSV manifest's header names a column twice (pyarrow reads the first of them, Python's csv the
    last, and refuses it: :func:`_unique_columns`)."""
    with _opened(manifest, storage) as f:
        first = f.read(1 << 20)
    try:
        names = next(csv.reader(io.StringIO(first.decode("utf-8-sig", errors="replace"), newline="")), [])
    except csv.Error:
        return True  # (read row by row, where it is reported)
    return len(set(names)) < len(names)


def _json_counted(blocks: Iterable[bytes]) -> int | None:
    """The rows of a JSON-lines file (``blocks``): its lines with more than white space (:func:`_filled_lines`;
    pyarrow and Python's json skip the others), where no carriage return stands alone (Python's file reading ends
    a line there, pyarrow does not); None otherwise."""
    return _filled_lines(blocks, alone=_LONE_RETURN)


def _filled_lines(blocks: Iterable[bytes], alone: re.Pattern | None = None) -> int | None:
    """The lines of a file (``blocks``) with more than white space (as Python's ``str.strip`` sees it); None where
    ``alone`` is found in a line. Its line breaks counted, less its lines of white space (found from the line break
    before each: a regular expression's quick search for a byte)."""
    n, tail = 0, b""
    for block in blocks:
        joined = tail + block  # (its whole lines: the last block's unfinished line, then this one's to its last break)
        cut = joined.rfind(b"\n") + 1
        if alone is not None and alone.search(joined, 0, cut):
            return None
        n += joined.count(b"\n", 0, cut) - len(_BLANK_LINE.findall(joined, 0, cut)) - \
            bool(cut and _BLANK_FIRST.match(joined, 0, cut))
        tail = joined[cut:]
    if alone is not None and alone.search(tail):
        return None
    return n + (_SPACES.fullmatch(tail) is None)


_SPACE = (rb"(?:[ \t\x0b\x0c\r\x1c-\x1f]|\xc2[\x85\xa0]|\xe1\x9a\x80|\xe2\x80[\x80-\x8a\xa8\xa9\xaf]|\xe2\x81\x9f"
          rb"|\xe3\x80\x80)")  # white space to Python's str.strip, in UTF-8 (NBSP, U+2028, U+3000 too)
_BLANK_LINE = re.compile(rb"\n" + _SPACE + rb"*(?=\n)")  # a line of white space, after the line break before it
_BLANK_FIRST = re.compile(_SPACE + rb"*\n")  # the first line, so
_SPACES = re.compile(_SPACE + rb"*")
_LONE_RETURN = re.compile(rb"\r(?!\n)")


_QUOTE, _COMMA, _BREAK, _RETURN = ord('"'), ord(","), ord("\n"), ord("\r")
_BEFORE_OPENING = np.isin(np.arange(256), [_QUOTE, _COMMA, _BREAK])  # a value's start (or a doubled quote's second)
_AFTER_CLOSING = np.isin(np.arange(256), [_QUOTE, _COMMA, _BREAK, _RETURN])  # a value's end (or a doubled quote)


def _csv_rows(blocks: Iterable[bytes]) -> int | None:
    """The rows of the rest of a CSV (``blocks``, after its header) counted from its bytes, where pyarrow and
    Python's csv read them alike: a line break (``\\n`` or ``\\r\\n``) ends a row outside quotes only (a quoted
    value may hold one, its quotes doubled), a blank line is no row to either; a quote opens a value only at its
    start and closes it only at its end (``ab"c`` or ``"ab"c``: read otherwise by each, so None); no carriage
    return outside quotes but before a line break. None otherwise. Quotes and line breaks found in bulk, a block at
    a time (about 0.15 s of CPU a million rows)."""
    n, quotes, tail, ended = 0, 0, np.full(2, _BREAK, np.uint8), True
    for block in blocks:
        if not block:
            continue
        data = np.concatenate([tail, np.frombuffer(block, np.uint8)])  # (the last block's last two bytes first)
        at = np.flatnonzero(data[2:] == _QUOTE) + 2
        opening = (np.arange(len(at)) + quotes) % 2 == 0  # (quotes alternate: one opens a value, the next closes it)
        closing = at[~opening]
        if quotes % 2 == 0 and data[1] == _QUOTE:
            closing = np.r_[1, closing]  # (the last block's closing quote, its last byte: what follows it)
        if not _BEFORE_OPENING[data[at[opening] - 1]].all() or \
                not _AFTER_CLOSING[data[np.minimum(closing + 1, len(data) - 1)]].all():
            return None  # (a closing quote last in the block: what follows it is checked with the next block)
        ends, returns = (_outside(data, at, quotes, byte) for byte in (_BREAK, _RETURN))
        if (data[np.minimum(returns + 1, len(data) - 1)] != _BREAK)[returns < len(data) - 1].any() or \
                (data[1] == _RETURN and quotes % 2 == 0 and data[2] != _BREAK):
            return None  # a carriage return alone (one last in the block: the next block's first byte)
        blank = (data[ends - 1] == _BREAK) | ((data[ends - 1] == _RETURN) & (data[ends - 2] == _BREAK))
        n += int(len(ends) - blank.sum())
        quotes += len(at)
        ended = bool(len(ends)) and ends[-1] == len(data) - 1
        tail = data[-2:]
    if quotes % 2 or tail[-1] == _RETURN:
        return None  # a quote left open at the end; a carriage return last
    return n + (not ended)  # (a last row without a line break)


def _outside(data: np.ndarray, quotes_at: np.ndarray, quotes_before: int, byte: int) -> np.ndarray:
    """Where ``byte`` is in ``data`` past its first two (the last block's) outside quoted values."""
    found = np.flatnonzero(data[2:] == byte) + 2
    return found[(np.searchsorted(quotes_at, found) + quotes_before) % 2 == 0]


def _json_rows(manifest: str, storage: dict) -> int:
    """The lines of a JSON-lines manifest with more than white space (its rows, as Python's json reads them: what
    pyarrow reads is checked against them, since it also takes two objects on a line, or one over several)."""
    with _opened(manifest, storage) as f:
        n = _filled_lines(iter(lambda: f.read(16 << 20), b""))
    assert n is not None
    return n


def _checked(manifest: str, rows: Rows, where: Any) -> Rows:
    """The rows of a manifest, their ids checked to be unique."""
    twice = duplicate(rows.ids)
    if twice is not None:
        raise DataError(f"{manifest}: id {rows.ids[twice[0]]!r} appears in rows {twice[0] + 1} and {twice[1] + 1}; "
                        "ids must be unique")
    return rows


# a path that absolute() changes (., .., //, a trailing /) or that is read otherwise (a backslash climbing out,
# file://): a manifest with one is read row by row
_UNUSUAL = r"(^|/)\.\.?(/|$)|(^|[^:])//|\\|/$|^file://|\x00"


def _arrow_bulk(manifest: str, storage: dict, head: str, names: _Columns, outside_root: bool) -> Rows | None:
    """A CSV or JSON-lines manifest's rows read by pyarrow a block at a time, made in bulk (issue 57: Python's csv and a
    path joined and checked a row at a time were 11 s of CPU a million rows): the rows the reader of every manifest
    makes (a remote one read as it is parsed, never held whole). None where that reader is the one to take (it
    reports, or reads row by row): pyarrow not installed, not a CSV, a local one not there, a row without its image
    or its columns, a path that leaves the root or that absolute() changes."""
    if not _bulk_reads(manifest) or (not _json(manifest) and _named_twice(manifest, storage)):
        return None
    bulk = _Bulk(head, names, outside_root)
    with _blocks(manifest, storage, names) as blocks:
        if not all(block is not None and bulk.take(*block) for block in blocks):
            return None
    if _json(manifest) and len(bulk.which) != _json_rows(manifest, storage):
        return None  # (a line of two objects, or an object over lines: Python's json refuses it, naming the line)
    return bulk.rows(lambda n: f"{manifest} row {n + 1}")


BLOCK_BYTES = 1 << 20  # a block of a manifest, as pyarrow reads it


@contextlib.contextmanager
def _blocks(manifest: str, storage: dict, names: _Columns,
            labels_only: bool = False) -> Iterator[Iterator[tuple[Any, Any, Any] | None]]:
    """The image, id and label columns of a CSV or JSON-lines manifest (Arrow arrays, a block of rows at a time;
    a JSON id as text); None, the last, where Python's csv or json reads the file otherwise, or reports what is
    wrong with it (pyarrow cannot parse a block, or it is not UTF-8): the caller lists it row by row then.
    ``labels_only``: a CSV's other columns not made (None in their place)."""
    import pyarrow as pa
    from pyarrow import csv

    wanted = [names.label] if labels_only else [names.image, names.id, names.label]

    def blocks(f: Any) -> Generator[tuple[Any, Any, Any] | None, None, None]:
        try:
            if _json(manifest):
                yield from _json_blocks(f, _json_types(manifest, storage, names), names)
                return
            reader = csv.open_csv(f, read_options=csv.ReadOptions(block_size=BLOCK_BYTES),
                                  parse_options=csv.ParseOptions(newlines_in_values=True),
                                  convert_options=csv.ConvertOptions(
                                      include_columns=wanted, include_missing_columns=True, strings_can_be_null=False,
                                      column_types=dict.fromkeys(wanted, pa.string())))
            for batch in reader:
                yield (None, None, batch.column(0)) if labels_only else \
                    (batch.column(0), batch.column(1), batch.column(2))
        except (pa.ArrowInvalid, UnicodeDecodeError, _NotBulk):
            yield None
        except Exception as err:
            if is_url(manifest):  # its storage failed as it was read
                raise remote_error("data.manifest", manifest, err) from err
            raise

    with _opened(manifest, storage) if is_url(manifest) else contextlib.nullcontext(manifest) as f, \
            contextlib.closing(blocks(f)) as read:  # (its reader closed before the file it reads)
        yield read


class _NotBulk(Exception):
    """A JSON-lines manifest that the bulk reader leaves to Python's json (its first row is not an object, or gives
    an id or label of a type that Arrow reads otherwise)."""


SNIFF_ROWS = 1000  # the first rows of a JSON-lines manifest whose ids and labels give their types (_json_types)


def _json_types(manifest: str, storage: dict, names: _Columns) -> Any:
    """The Arrow schema a JSON-lines manifest's image, id and label are read with, from the first of its first
    :data:`SNIFF_ROWS` rows (Python's json) that has each: the image a text; the id a text, or a whole number (made
    its decimal text, as ``str`` makes it); the label as that row gives it (a text, a whole number, a number, true
    or false). A row whose types differ is refused by Arrow: the file is then listed row by row."""
    import pyarrow as pa

    found: dict[str, type] = {}
    with _opened(manifest, storage) as f:
        for line in itertools.islice((ln for ln in f if ln.decode("utf-8", "replace").strip()), SNIFF_ROWS):
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise _NotBulk from None
            if not isinstance(row, dict):
                raise _NotBulk
            for name in (names.id, names.label):
                if row.get(name) is not None:
                    found.setdefault(name, type(row[name]))
            if len(found) == 2:
                break
    types = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
    if found.get(names.id, str) not in (str, int):
        raise _NotBulk
    return pa.schema([(names.image, pa.string()), (names.id, types[found.get(names.id, str)]),
                      (names.label, types.get(found.get(names.label, str), pa.string()))])


def _json_blocks(f: Any, schema: Any, names: _Columns) -> Iterator[tuple[Any, Any, Any]]:
    """A JSON-lines manifest's image, id (as texts) and label columns, a block of rows at a time."""
    import pyarrow as pa
    from pyarrow import json as arrow_json

    reader = arrow_json.open_json(f, read_options=arrow_json.ReadOptions(block_size=BLOCK_BYTES),
                                  parse_options=arrow_json.ParseOptions(explicit_schema=schema,
                                                                        unexpected_field_behavior="ignore"))
    for batch in reader:
        yield (batch.column(names.image), batch.column(names.id).cast(pa.string()), batch.column(names.label))


def _copy(source: Strings, to: Strings, part: int = 1 << 20) -> None:
    """Append every string of ``source`` to ``to``, ``part`` strings at a time (each a read of the spill file)."""
    texts = source.snapshot()
    for start in range(0, len(texts), part):
        piece = texts.part(start, min(start + part, len(texts)))
        to.extend_utf8(piece.data.tobytes(), piece.ends)


@dataclass(frozen=True)
class _Taken:
    """A block of a manifest's rows, ready to add to the builders (:meth:`_Bulk.prepare`)."""

    rows: int
    ids: Any  # Arrow strings: each row's id (its path where it names none)
    image: Any  # Arrow strings: each row's path as the manifest gives it
    label: Any  # Arrow strings (nulls: no label column), or int64 class indices (:class:`_ArrowCodes`)
    which: np.ndarray  # int32: 1 where the path is whole (absolute, a URL), 0 where it lies under the base
    any_whole: bool
    shared: bool  # every row's id is its path


class _Bulk:
    """The columns of a manifest's rows made from blocks of its image, id and label columns (Arrow arrays)."""

    def __init__(self, base: str, names: _Columns, outside_root: bool, codes: _ArrowCodes | None = None) -> None:
        self.base, self.names, self.outside_root = base, names, outside_root
        self.ids, self.tails = Strings(), Strings()
        # the labels: each row's code into their distinct values (their classes known once all are read), or each
        # row's class index where data.classes names them (``codes``: a manifest streamed)
        self.codes = codes
        self.labels: Distinct | Column = Distinct() if codes is None else Column("q")
        # shared: every row's id is its path, so far: the ids are the tails (not written twice: at 10M rows a third
        # of what the listing spills), copied into ``ids`` at the first row whose id is not its path
        self.which, self.shared = Column("i"), True
        self.any_whole = False  # whether a row's path is whole (absolute, a URL), not under the base

    def take(self, image: Any, given: Any, label: Any) -> bool:
        """Take a block's rows; False where the row-by-row reader is the one to read them (or refuse them)."""
        taken = self.prepare(image, given, label)
        if taken is not None:
            self.add(taken)
        return taken is not None

    def check(self, image: Any, given: Any, label: Any) -> Any:
        """Which of a block's paths are whole (absolute, URLs: an Arrow boolean array); None where the row-by-row
        reader is the one to read them (or refuse them)."""
        import pyarrow.compute as pc

        if image.null_count or not pc.all(pc.greater(pc.binary_length(image), 0)).as_py() or \
                pc.any(pc.match_substring_regex(image, _UNUSUAL)).as_py():
            return None  # a row without its image, or a path made absolute otherwise
        whole = pc.or_(pc.starts_with(image, "/"), pc.match_substring(image, "://"))
        if pc.any(whole).as_py() and not self.outside_root:
            return None  # refused, naming the first
        if any(self.names.mapped.get(c) and column.null_count == len(column) > 0
               for c, column in ((self.names.id, given), (self.names.label, label))):
            return None  # a column data.columns names that the file lacks: refused
        return whole

    def prepare(self, image: Any, given: Any, label: Any) -> _Taken | None:
        """A block's rows made ready to add; None where the row-by-row reader is the one
        to read them (or refuse them)."""
        import pyarrow.compute as pc

        whole = self.check(image, given, label)
        if whole is None:
            return None
        named = pc.fill_null(given, "")  # (no id: its path, as an empty one)
        row_ids = pc.if_else(pc.greater(pc.binary_length(named), 0), named, image)
        labels = label if self.codes is None else self.codes.coded(label)
        return _Taken(len(image), row_ids, image, labels, np.asarray(whole.to_numpy(zero_copy_only=False), np.int32),
                      bool(pc.any(whole).as_py()), pc.all(pc.equal(row_ids, image)).as_py())

    def add(self, taken: _Taken) -> None:
        """A block's rows, :meth:`prepare`-d."""
        if self.shared and not taken.shared:
            _copy(self.tails, self.ids)
        self.shared = self.shared and taken.shared
        if not self.shared:
            self.ids.extend_arrow(taken.ids)
        self.tails.extend_arrow(taken.image)
        self.which.extend(taken.which)
        self.any_whole = self.any_whole or taken.any_whole
        if isinstance(self.labels, Column):
            self.labels.extend(taken.label)
        else:
            self.labels.add_arrow(taken.label)  # (no label column: every row's label is None)

    def prefix(self) -> Rows:
        """The rows taken so far (none copied: maps of the builders' files), the reading going on: a manifest without
        labels, or with labels that data.classes names (:func:`_stream_manifest`)."""
        tails = self.tails.snapshot()
        ids = tails if self.shared else self.ids.snapshot()
        which = self.which.snapshot() if self.any_whole else None
        labels = self.labels.snapshot() if isinstance(self.labels, Column) else \
            np.broadcast_to(np.int64(-1), (len(ids),))
        return Rows(ids=ids, paths=Joined([self.base, ""], tails, which), labels=labels)

    def rows(self, where: Any) -> Rows:
        listed = (self.tails if self.shared else self.ids).array()
        labels, classes = (self.labels.array(), []) if isinstance(self.labels, Column) else \
            labels_of_codes(*self.labels.result(), where)  # (class indices: named by data.classes after)
        which = self.which.array()
        tails = listed if self.shared else self.tails.array()
        paths = Joined([self.base, ""], tails, which if self.any_whole else None)
        return Rows(ids=listed, paths=paths, labels=labels, classes=classes)


class _Columns:
    """A manifest's column names (``data.columns`` over the defaults path, id, label), and which of the label
    and id columns the user named were seen in a row."""

    def __init__(self, manifest: str, columns: dict[str, str]) -> None:
        named = {"image": "path", "id": "id", "label": "label", **columns}
        self.manifest, self.image, self.id, self.label = manifest, named["image"], named["id"], named["label"]
        self.mapped = {v: k for k, v in columns.items() if k != "image"}  # label and id columns named by the user
        self.seen: set[str] = set()

    def image_of(self, rec: Any, n: int) -> str:
        """The image path of record ``rec`` (row ``n``); a row without one is refused naming the columns."""
        if not isinstance(rec, dict) or not rec.get(self.image):
            there = f" ({', '.join(map(repr, list(rec)[:8]))} there)" if isinstance(rec, dict) else ""
            raise DataError(f"{self.manifest} row {n + 1}: missing {self.image!r}{there}; the columns are "
                            f"{self.image}, optional {self.id} and {self.label} (data.columns maps other names: "
                            "{image: file_name})")
        if self.mapped:
            self.seen.update(k for k in self.mapped if k in rec)
        return str(self.scalar(rec, self.image, n))

    def scalar(self, rec: dict[str, Any], name: str, n: int) -> Any:
        """Column ``name`` of record ``rec`` (row ``n``), refused where it is a JSON object or list (its text as
        Python writes it was taken for a path, an id or a class name)."""
        value = rec.get(name)
        if isinstance(value, dict | list):
            kind = "object" if isinstance(value, dict) else "list"
            raise DataError(f"{self.manifest} row {n + 1}: {name!r} is a JSON {kind} ({json.dumps(value)[:60]}); give "
                            "a text or a number there, or map another key in data.columns")
        return value

    def check_seen(self) -> None:
        """Refuse a label or id column named in data.columns that no row has."""
        for what in sorted(set(self.mapped) - self.seen):
            raise DataError(f"data.columns.{self.mapped[what]}: {what!r} is not a column of {self.manifest}; fix "
                            "the name, or remove it from data.columns")


def _manifest_records(manifest: str, storage: dict) -> Iterator[Any]:
    """The rows of a CSV or JSONL manifest (local or a URL), parsed one at a time as the file is read (the whole
    text and a list of every row's record held at once were 300 bytes a row at the peak of planning)."""
    suffix = _suffix(manifest)
    if suffix not in (".csv", ".jsonl", ".ndjson"):
        raise DataError(f"data.manifest {manifest}: expected a .csv, .jsonl or .ndjson file"
                        + (" (uncompressed: decompress it first)" if suffix in _COMPRESSED else ""))
    # (a spreadsheet's byte-order mark is not a column name)
    with io.TextIOWrapper(_opened(manifest, storage), encoding="utf-8-sig", newline="") as lines:
        reader = csv.DictReader(lines) if suffix == ".csv" else None
        try:
            yield from _unique_columns(manifest, reader) if reader is not None else _json_lines(manifest, lines)
        except UnicodeDecodeError as err:
            raise DataError(f"data.manifest {manifest} is not UTF-8 text (line {_not_utf8(manifest, storage)}: "
                            f"{err.reason}, {err.object[err.start:err.end]!r}); save it as UTF-8") from None
        except DataError:
            raise
        except csv.Error as err:  # (a value over csv's field limit, 128 KiB; a NUL byte in an old Python)
            line = reader.line_num + 1 if reader else "?"  # (the line being read)
            raise DataError(f"data.manifest {manifest} line {line} is not a row Python's csv reads ({err}); fix that "
                            "line") from None
        except Exception as err:
            if is_url(manifest):  # its storage failed as it was read
                raise remote_error("data.manifest", manifest, err) from err
            raise


_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")


def _not_utf8(manifest: str, storage: dict) -> int:
    """The first line of a manifest that is not UTF-8 (read again, once it was found not to be)."""
    with _opened(manifest, storage) as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return n
    return 0


def _unique_columns(manifest: str, reader: csv.DictReader) -> Iterator[dict[str, Any]]:
    """A CSV's records, its header refused where it names a column twice (pyarrow takes the first of them, Python's
    csv the last)."""
    names = reader.fieldnames or []
    twice = sorted({c for c in names if names.count(c) > 1})
    if twice:
        raise DataError(f"data.manifest {manifest}: its header names column {twice[0]!r} twice; name each once")
    yield from reader


def _suffix(manifest: str) -> str:
    return Path(manifest.split("?", 1)[0]).suffix.lower()


def _opened(manifest: str, storage: dict) -> BinaryIO:
    """The manifest's bytes, read as they are parsed: a local file, or a remote one a block at a time (a list of
    100M rows is gigabytes: never held whole)."""
    if not is_url(manifest):
        if not Path(manifest).exists():
            raise DataError(f"data.manifest {manifest} does not exist")
        return open(manifest, "rb")  # (the caller's to close)
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(manifest, **storage)
        return fs.open(path, "rb", block_size=4 << 20)
    except Exception as err:
        raise remote_error("data.manifest", manifest, err) from err


def _json_lines(manifest: str, lines: Iterable[str]) -> Iterator[Any]:
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{manifest}:{lineno}: not valid JSON: {err.msg}") from None



class ManifestSource(Source):
    """A manifest (``data.manifest``): a CSV or JSON-lines file of rows, each a path or URL, an id, a label."""

    name = "manifest"
    prints_on_read = True  # (a stat a row: 3.3 s of CPU a million rows of the listing, measured)

    def empty(self, data: DataSpec) -> str:
        return "it holds no rows: a header at most"  # (a manifest's rows are not filtered by data.extensions)

    def list(self, data: DataSpec) -> Rows:
        assert data.manifest is not None  # the spec validator guarantees it
        listing = self.listing(data)  # before the read: a manifest written meanwhile is read again next time
        rows = _list_manifest(data.manifest, data.root, data.storage_options, data.outside_root,
                              {str(k): v for k, v in data.columns.items()})
        return replace(rows, listing=listing)

    def stream(self, data: DataSpec, then: Callable[[Rows], Rows]) -> Streamed | None:
        assert data.manifest is not None
        return _stream_manifest(data.manifest, data.root, data.storage_options, data.outside_root,
                                {str(k): v for k, v in data.columns.items()},
                                None if data.classes is None else list(data.classes),
                                lambda: self.listing(data), then)

    def names_first(self, data: DataSpec) -> bool:
        """Where its first block holds a name, or no label in a CSV whose header names the label column
        (:func:`_names_read_first`)."""
        assert data.manifest is not None
        manifest, storage = data.manifest, data.storage_options
        names = _Columns(manifest, {str(k): v for k, v in data.columns.items()})
        if not _bulk_reads(manifest):
            return False
        base = _made(_base(manifest, data.root).rstrip("/") + "/")
        taken = _first_taken(manifest, storage, _Bulk(base, names, data.outside_root, _ArrowCodes(manifest, None)))
        return _names_read_first(manifest, storage, names, taken)

    def listing(self, data: DataSpec, was: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """A local manifest's size, mtime and content digest, and the settings that change its rows."""
        assert data.manifest is not None
        if is_url(data.manifest) or not os.path.isfile(data.manifest):
            return None
        import xxhash

        h = xxhash.xxh3_64()
        with open(data.manifest, "rb") as f:
            st = os.fstat(f.fileno())
            while block := f.read(1 << 22):
                h.update(block)
        root = None if data.root is None else data.root if is_url(data.root) else absolute(data.root)
        return {"source": self.name, "manifest": absolute(data.manifest), "size": st.st_size,
                "mtime": st.st_mtime_ns, "digest": h.hexdigest(), "root": root, "outside_root": data.outside_root,
                "columns": dict(sorted((str(k), v) for k, v in data.columns.items()))}

    def sample(self, data: DataSpec, parts: int, over: int) -> Sampled | None:
        """The manifest's first ``parts`` megabytes (whole lines; its header with them), in a file of their own,
        its paths read against the same root."""
        assert data.manifest is not None
        manifest, storage = data.manifest, data.storage_options
        try:
            if is_url(manifest):
                import fsspec

                fs, path = fsspec.core.url_to_fs(manifest, **storage)
                total = int(fs.size(path))
                opened = fs.open(path, "rb")
            else:
                total, opened = os.path.getsize(manifest), open(manifest, "rb")  # noqa: SIM115 - closed below
        except Exception:  # noqa: BLE001 - the listing reports what is wrong with it
            return None
        if total <= over * PART_BYTES:
            opened.close()
            return None
        with opened:
            head = opened.read(parts * PART_BYTES)
        head = head[:head.rfind(b"\n") + 1]
        folder = tempfile.mkdtemp(prefix="extractor-sample-")
        part = os.path.join(folder, os.path.basename(manifest.split("?", 1)[0]))
        with open(part, "wb") as f:
            f.write(head)
        base = data.root if data.root is not None else manifest.rsplit("/", 1)[0] if "/" in manifest else "."
        sampled = Sampled(data.model_copy(update={"manifest": part, "root": base}), len(head), total,
                          "bytes of the manifest")
        weakref.finalize(sampled, shutil.rmtree, folder, True)  # the part's file, once the sample is let go
        return sampled


SOURCE = ManifestSource()
