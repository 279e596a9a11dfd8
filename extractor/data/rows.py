"""The data set as rows, and its shards: row order, labels, the unit of work.

Row order is deterministic: a folder is walked in sorted order, a manifest is read in file
order, tars in pattern order, so the same spec always gives the same row for the same image.
"""

from __future__ import annotations

import functools
import logging
import operator
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import numpy as np

from ..errors import DataError, RemakeError
from . import spill
from .spill import Bytes, Column, by_hash

__all__ = [
    "ClassCodes",
    "Distinct",
    "Joined",
    "Joining",
    "Rows",
    "Shard",
    "Strings",
    "Texts",
    "distinct",
    "duplicate",
    "first_where",
    "label_number",
    "labels_of",
    "labels_of_codes",
    "looked_up",
    "missing_label",
    "named",
    "plan",
    "strings",
    "text_hashes",
    "utf8",
    "whole_number",
]

log = logging.getLogger(__name__)

STRINGS = np.dtypes.StringDType()
BLOCK = 1 << 16  # strings decoded at a time (iterating, hashing, writing)


def strings(items: Iterable[str]) -> Texts | np.ndarray:
    """Strings as one compact column (:class:`Texts`), gathered one at a time: no list of all of them is ever
    held. A numpy array of strings or a Texts given is kept as it is."""
    if isinstance(items, Texts) or (isinstance(items, np.ndarray) and items.dtype == STRINGS):
        return items
    gathered = Strings()
    for item in items:
        gathered.append(item)
    return gathered.array()


ENCODING = ("utf-8", "surrogatepass")  # every Python str round-trips, a file name's escaped bytes included


class Texts:
    """Strings held as their UTF-8 bytes in one buffer and where each ends: 8 bytes a string beside its text
    (a numpy StringDType array: 16, and 8 more in its arena beside a text over 15 bytes; a ``str`` in a list: 60).
    The ids and paths a source lists, at 10M rows. Indexing gives a ``str``; a slice, a StringDType array."""

    def __init__(self, data: np.ndarray, ends: np.ndarray) -> None:
        self.data = data  # uint8: every string's UTF-8, one after another
        self.ends = ends  # int64: where string i's bytes end (its start: where string i - 1's end, or 0)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return np.asarray([self[n] for n in range(start, stop, step)], dtype=STRINGS)
            return np.asarray(self._decoded(start, stop), dtype=STRINGS)
        n = operator.index(i)
        if not -len(self) <= n < len(self):
            raise IndexError(f"string {n} of {len(self)}")
        n %= len(self)
        start = int(self.ends[n - 1]) if n else 0
        return self.data[start:int(self.ends[n])].tobytes().decode(*ENCODING)

    def _decoded(self, start: int, stop: int) -> list[str]:
        if start >= stop:
            return []
        base = int(self.ends[start - 1]) if start else 0
        raw = self.data[base:int(self.ends[stop - 1])].tobytes()
        cuts = (self.ends[start:stop] - base).tolist()
        if raw.isascii():  # most ids and paths: one decode, then slices of the text
            text = raw.decode("ascii")
            return [text[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
        return [raw[a:b].decode(*ENCODING) for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self), BLOCK):
            yield from self._decoded(start, min(start + BLOCK, len(self)))

    def part(self, start: int, stop: int) -> Texts:
        """Strings ``start:stop`` as a Texts (their bytes not copied, nor decoded)."""
        base = int(self.ends[start - 1]) if start else 0
        ends = np.asarray(self.ends[start:stop], dtype=np.int64)
        return Texts(self.data[base:int(self.ends[stop - 1]) if stop > start else base], ends - base if base else ends)

    def tolist(self) -> list[str]:
        return self._decoded(0, len(self))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.tolist(), dtype=STRINGS if dtype is None else dtype)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.ends.nbytes)


class Strings:
    """Strings appended one by one into a :class:`Texts`: their UTF-8 into one growing buffer, where each ends
    into another (no Python object kept a string), both spilled onto the disk past a megabyte
    (:mod:`.spill`: a listing of 400M rows is not held in the driver's memory)."""

    def __init__(self) -> None:
        self.held = bytearray()  # the bytes not spilled yet
        self.data = Bytes()  # the bytes spilled
        self.ends = Column("q")

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, n: int) -> str:
        """String ``n`` of those appended so far (before :meth:`array`)."""
        start, stop, spilled = self.ends[n - 1] if n else 0, self.ends[n], len(self.data)
        if start >= spilled:
            return self.held[start - spilled:stop - spilled].decode(*ENCODING)
        return (self.data.read(start, min(stop, spilled)) + self.held[:max(0, stop - spilled)]).decode(*ENCODING)

    def append(self, item: str) -> None:
        held = self.held
        held += item.encode(*ENCODING)
        self.ends.append(self.data.written + len(held))
        if len(held) >= spill.SPILL_BYTES:
            self._spill()

    def extend(self, items: Iterable[str]) -> None:
        """Append ``items``: encoded, joined and their ends summed at once (a tar's 10,000 keys)."""
        encoded = [item.encode(*ENCODING) for item in items]
        if encoded:
            ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded))) + self.data.written + \
                len(self.held)
            self.held += b"".join(encoded)
            self.ends.extend(ends)
            if len(self.held) >= spill.SPILL_BYTES:
                self._spill()

    def extend_utf8(self, data: bytes | memoryview, ends: np.ndarray) -> None:
        """Append strings given as their UTF-8, one after another, and where each ends in it (an Arrow column's
        buffers: no string made)."""
        self.ends.extend(np.asarray(ends, dtype=np.int64) + self.data.written + len(self.held))
        self.held += data
        if len(self.held) >= spill.SPILL_BYTES:
            self._spill()

    def extend_arrow(self, column: Any) -> None:
        """Append an Arrow string array's values from its buffers (none made a ``str``; no nulls)."""
        kind = np.int64 if column.type.id == _large_string_id() else np.int32
        offsets = np.frombuffer(column.buffers()[1], dtype=kind)[column.offset:column.offset + len(column) + 1]
        data = column.buffers()[2]
        self.extend_utf8(memoryview(data)[int(offsets[0]):int(offsets[-1])] if data is not None else b"",
                         offsets[1:] - offsets[0])

    def _spill(self) -> None:
        self.data += self.held
        self.held = bytearray()

    def array(self) -> Texts:
        """All of them (this gathers anew from empty)."""
        self._spill()
        return Texts(self.data.array(), self.ends.array())

    def snapshot(self) -> Texts:
        """Those appended so far, the builder going on (:meth:`.spill.Column.snapshot`)."""
        self._spill()
        return Texts(self.data.snapshot(), self.ends.snapshot())


def utf8(strings: Any, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Strings ``start:stop`` (a Texts, a Joined, an array of strings) as their UTF-8 one after another (uint8) and
    where each ends (int64), made in bulk: no ``str`` made of a Texts or a Joined's tails. None where one holds a
    surrogate (a file name's escaped byte): its bytes depend on the error handler, the caller's to choose."""
    stop = min(stop, len(strings))
    if isinstance(strings, Texts):
        part = strings.part(start, stop)
        data, ends = np.asarray(part.data), part.ends
    elif isinstance(strings, Joined):
        return strings.utf8(start, stop)
    else:
        encoded = [s.encode(*ENCODING) for s in np.asarray(strings[start:stop], dtype=STRINGS).tolist()]
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)))
    lead = np.flatnonzero(data[:-1] == 0xED)  # a surrogate's UTF-8 (surrogatepass): ED A0..BF ..
    if len(lead) and (data[lead + 1] >= 0xA0).any():
        return None
    return data, ends


_TENS = 10 ** np.arange(20, dtype=np.uint64)  # a whole number's digits: how many of these it reaches


def _pieces(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's strings from several parts, one after another: a part is (its bytes, each row's start in them,
    each row's length); the rows' bytes joined and where each row ends."""
    lengths = np.stack([p[2] for p in parts], axis=1)  # (rows, parts), in the order of the output
    ends = np.cumsum(lengths.sum(1))
    source = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint8)
    bases = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])
    starts = np.stack([p[1] + b for p, b in zip(parts, bases, strict=True)], axis=1)
    flat_len, flat_start = lengths.reshape(-1), starts.reshape(-1)
    at = np.cumsum(flat_len) - flat_len  # where each piece begins in the output
    gather = np.arange(int(flat_len.sum()), dtype=np.int64) + np.repeat(flat_start - at, flat_len)
    return source[gather], ends


def _encoded(texts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Strings' UTF-8 one after another, where each starts, and its length."""
    encoded = [t.encode(*ENCODING) for t in texts.tolist()]
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    return np.frombuffer(b"".join(encoded), np.uint8), np.cumsum(lengths) - lengths, lengths


def _few(texts: tuple[np.ndarray, np.ndarray, np.ndarray], codes: np.ndarray | None,
         n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A part of :func:`_pieces` from a few strings (:func:`_encoded`) and each row's code into them (None: the
    first)."""
    data, starts, lengths = texts
    codes = np.zeros(n, np.int64) if codes is None else np.asarray(codes, dtype=np.int64)
    return data, starts[codes], lengths[codes]


@dataclass(frozen=True)
class Joined:
    """Many strings sharing a few heads, held as the heads and each string's tail: string ``i`` is
    ``heads[which[i]] + tails[i]`` (``which`` None: every string has head 0), and ``ends[end[i]]`` after it where
    ``end`` is given. A folder's paths are its root and the ids; a tar source's are the tars, the ids (the array
    of the rows' ids, held once) and the members' extensions. Indexing gives a ``str``; a slice, an array."""

    heads: Any  # strings, made a StringDType array (a few, indexed by ``which`` at once)
    tails: np.ndarray | Texts  # strings, or integers (a Parquet row's number in its file)
    which: np.ndarray | None = None
    ends: Any = None  # strings after the tails (a few), made a StringDType array; None: none
    end: np.ndarray | None = None  # each string's index into ``ends``

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", np.asarray(self.heads, dtype=STRINGS))
        if self.ends is not None:
            object.__setattr__(self, "ends", np.asarray(self.ends, dtype=STRINGS))

    def __len__(self) -> int:
        return len(self.tails)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            heads = self.heads[0] if self.which is None else self.heads[self.which[i]]
            tails = self.tails[i]
            out = np.strings.add(heads, tails.astype(STRINGS) if tails.dtype.kind in "iu" else tails)
            return out if self.end is None else np.strings.add(out, self.ends[self.end[i]])
        text = str(self.heads[0 if self.which is None else self.which[i]]) + str(self.tails[i])
        return text if self.end is None else text + str(self.ends[self.end[i]])

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self), BLOCK):
            yield from self[start:start + BLOCK].tolist()

    def tolist(self) -> list[str]:
        return list(self)

    def utf8(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
        """:func:`utf8` of strings ``start:stop``: each one's head, tail and end gathered at once."""
        stop = min(stop, len(self))
        n = max(0, stop - start)
        if isinstance(self.tails, np.ndarray) and self.tails.dtype.kind in "iu":  # a Parquet row's number
            tails = np.asarray(self.tails[start:stop])
            if len(tails) and tails.min() < 0:
                return None
            tails = tails.astype(np.uint64)  # (compared as uint64: int64 against uint64 is float64's)
            lengths = np.maximum(np.searchsorted(_TENS, tails, side="right"), 1).astype(np.int64)
            width = int(lengths.max(initial=1))  # each number's digits, right-aligned in a row of this many
            digits = (tails[:, None] // _TENS[width - 1::-1] % 10 + ord("0")).astype(np.uint8)
            tail = (digits[np.arange(width) >= width - lengths[:, None]], np.cumsum(lengths) - lengths, lengths)
        else:
            found = utf8(self.tails, start, stop)
            if found is None:
                return None
            data, ends = found
            lengths = np.diff(ends, prepend=0)
            tail = (data, ends - lengths, lengths)
        parts = [_few(self._heads_utf8, None if self.which is None else self.which[start:stop], n), tail]
        if self.end is not None:
            parts.append(_few(self._ends_utf8, self.end[start:stop], n))
        return _pieces(parts)

    @functools.cached_property
    def _heads_utf8(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The heads' UTF-8, where each starts, and its length (once: a Parquet source's thousands of files)."""
        return _encoded(self.heads)

    @functools.cached_property
    def _ends_utf8(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _encoded(self.ends)


class Joining:
    """Strings gathered into a :class:`Joined` of the heads given and ``""``: each one given whole (held as
    head 0 and the rest when it starts with head 0, else whole), or as a head's index and a tail.

    ``ids``: the rows' ids, each appended before its string. While every tail is its row's id (a folder's
    relative paths, a manifest's paths without an id column) no tail is kept: the Joined takes the ids' array."""

    def __init__(self, heads: Iterable[str], ids: Strings | None = None) -> None:
        self.heads = [*heads, ""]
        self.tails = Strings()
        self.which = Column("i")
        self.ids = ids  # None once a tail differs from its id

    def whole(self, text: str) -> None:
        if text.startswith(self.heads[0]):
            self.part(0, text[len(self.heads[0]):])
        else:
            self.part(len(self.heads) - 1, text)

    def parts(self, head: int, tails: Sequence[str], are_ids: bool = False) -> None:
        """Strings ``heads[head] + tail`` for each of ``tails`` (``are_ids``: the ids appended last, one each)."""
        if self.ids is not None:
            if are_ids:  # each tail is its row's id still: none kept
                self.which.extend([head] * len(tails))
                return
            for tail in tails:
                self.part(head, tail)
            return
        self.which.extend([head] * len(tails))
        self.tails.extend(tails)

    def part(self, head: int, tail: str) -> None:
        if self.ids is not None:
            if tail == self.ids[len(self.which)]:
                self.which.append(head)
                return
            for n in range(len(self.which)):  # the first that differs: the tails so far were the ids
                self.tails.append(self.ids[n])
            self.ids = None
        self.which.append(head)
        self.tails.append(tail)

    def snapshot(self, ids: Texts) -> Joined:
        """The first strings gathered, as many as ``ids`` (a prefix of the ids given at the start), the gathering
        going on (:meth:`.spill.Column.snapshot`: none copied)."""
        tails = ids if self.ids is not None else self.tails.snapshot().part(0, len(ids))
        return Joined(np.asarray(self.heads, dtype=STRINGS), tails, self.which.snapshot()[:len(ids)])

    def joined(self, ids: Texts | np.ndarray | None = None) -> Joined:
        """The strings; ``ids``: the array the ids given at the start became."""
        which = self.which.array()
        tails: Texts | np.ndarray = self.tails.array() if self.ids is None or ids is None else ids
        return Joined(np.asarray(self.heads, dtype=STRINGS), tails, which if which.any() else None)


@dataclass(frozen=True)
class LocatorArray:
    """A per-row array a data source keeps in the store beside ``paths``, to find a row's bytes where a path alone
    does not (declared on its ``Source.locators``; the rows of its listing carry one column of it)."""

    name: str  # the store's array
    dtype: str  # numpy's name of its type
    fill: Any  # what a row holds where the source gave nothing


@dataclass(frozen=True)
class Rows:
    """The data set as the store records it: one entry per row, in row order, each column one numpy array (a
    list given is made one): at 10M rows a list of strings and ints was gigabytes of the driver's memory."""

    ids: Texts | np.ndarray | Joined  # strings: a Texts (or a StringDType array, or a Joined)
    paths: Texts | np.ndarray | Joined  # strings, or Joined: the same paths, their shared heads held once
    labels: np.ndarray  # int64, -1: none
    classes: list[str] = field(default_factory=list)
    locators: Mapping[str, np.ndarray] = field(default_factory=dict)  # the source's locator arrays (its
    # ``Source.locators``, in that order), by the store's array names: one column each, where the source has them
    fingerprints: np.ndarray | None = None  # uint64 per row, where the source tells cheaply (0: unknown); see files
    listing: dict[str, Any] | None = None  # what the listing was made from (``Source.listing``), where it tells
    stored: dict[str, Any] | None = None  # rows a store records, left there (a resume whose source is as listed):
    # their number and digests (n_rows, ids_digest, paths_digest); the columns then are empty, and labels only read
    # when asked for

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.ids, Joined):
            put("ids", strings(self.ids))
        if not isinstance(self.paths, Joined):
            put("paths", strings(self.paths))
        put("labels", np.asarray(self.labels, dtype=np.int64).reshape(-1))
        if self.fingerprints is not None:
            put("fingerprints", np.asarray(self.fingerprints, dtype=np.uint64).reshape(-1))
        put("locators", {name: np.asarray(column).reshape(-1) for name, column in self.locators.items()})

    def __len__(self) -> int:
        return len(self.ids) if self.stored is None else int(self.stored["n_rows"])

    # as a listing streamed (:class:`~.streamed.Streamed`) is read: these rows are all listed
    @property
    def fingerprinted(self) -> bool:
        return self.fingerprints is not None

    @property
    def locator_names(self) -> tuple[str, ...]:
        return tuple(self.locators)

    def upto(self, stop: int) -> Rows:
        return self

    def whole(self) -> Rows:
        return self

    def on_disk(self) -> int:
        """Bytes of its columns spilled to the local disk (:mod:`.spill`: what the driver does not hold in memory)."""
        columns = [self.labels, self.fingerprints, *self.locators.values()]
        for strings in (self.ids, self.paths):
            if isinstance(strings, Joined):
                columns += [strings.which, strings.end]
                strings = strings.tails
            if isinstance(strings, Texts):
                columns += [strings.data, strings.ends]
            elif isinstance(strings, np.ndarray):
                columns.append(strings)
        return spill.on_disk(*columns)


def duplicate(ids: Any) -> tuple[int, int] | None:
    """The rows of the first id that appears again, as (its first row, the row it appears again in); None when
    all are unique. Found by sorting the ids' hashes (:func:`.spill.by_hash`: on the disk in buckets past 1M rows;
    a set of 10M ids was a gigabyte), the few rows whose hash another shares compared as strings."""
    shared = []
    for hashes, rows in by_hash(hash_blocks(ids), len(ids)):
        same = np.flatnonzero(hashes[1:] == hashes[:-1])
        if len(same):
            shared.append(rows[np.union1d(same, same + 1)])
    first: dict[str, int] = {}
    for row in np.sort(np.concatenate(shared)).tolist() if shared else []:  # in row order
        key = str(ids[row])
        if key in first:
            return first[key], row
        first[key] = row
    return None


def hash_blocks(ids: Any) -> Iterator[np.ndarray]:
    """A 64-bit hash of each string, a block at a time in order (a Texts' in bulk from its bytes:
    :func:`text_hashes`; others by Python's ``hash``: 4x faster than making them a Texts first)."""
    if isinstance(ids, Texts):
        step = BLOCK // 16  # its bytes' terms at 8 bytes each
        for start in range(0, len(ids), step):
            yield _text_hashes(ids, start, min(start + step, len(ids)))
        return
    for start in range(0, len(ids), BLOCK):
        yield np.asarray([hash(i) for i in ids[start:start + BLOCK].tolist()], dtype=np.int64)


def texts_part(strings: Any, start: int, stop: int) -> Any:
    """Strings ``start:stop`` as a Texts where they are held as bytes (a Texts' part; a Joined's made in bulk, but
    one holding a surrogate), else sliced as given."""
    stop = min(stop, len(strings))
    if isinstance(strings, Texts):
        return strings.part(start, stop)
    found = strings.utf8(start, stop) if isinstance(strings, Joined) else None
    return Texts(*found) if found is not None else strings[start:stop]


def text_hashes(texts: Texts | Sequence[str]) -> np.ndarray:
    """A 64-bit hash (int64) of each string from its UTF-8 (:func:`_text_hashes`), the same in every process, unlike
    Python's ``hash``: a store's index of its ids keeps them. A sequence that is not a Texts is made one a block at
    a time."""
    hashes = np.empty(len(texts), dtype=np.int64)
    if not isinstance(texts, Texts):
        for start in range(0, len(texts), BLOCK):
            part = texts_part(texts, start, start + BLOCK)
            if not isinstance(part, Texts):
                gathered = Strings()
                gathered.extend(list(part))
                part = gathered.array()
            hashes[start:start + BLOCK] = text_hashes(part)
        return hashes
    at = 0
    for block in hash_blocks(texts):
        hashes[at:at + len(block)] = block
        at += len(block)
    return hashes


_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def _text_hashes(texts: Texts, start: int, stop: int) -> np.ndarray:
    """Strings ``start:stop`` of a Texts hashed from their UTF-8 at once: the sum of (byte + 1) x M^position
    (modulo 2^64), mixed with the length."""
    base = int(texts.ends[start - 1]) if start else 0
    ends = texts.ends[start:stop].astype(np.int64) - base
    lengths = np.diff(ends, prepend=0)
    data = texts.data[base:base + int(ends[-1])]
    if not len(data):
        return lengths
    firsts = ends - lengths
    position = np.arange(len(data)) - np.repeat(firsts, lengths)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(int(lengths.max()), _MULTIPLIER, dtype=np.uint64))
        terms = (data.astype(np.uint64) + np.uint64(1)) * powers[position]
        sums = np.add.reduceat(terms, np.minimum(firsts, len(terms) - 1))
        sums[lengths == 0] = 0
        return (sums * _MULTIPLIER + lengths.astype(np.uint64)).view(np.int64)


@dataclass(frozen=True)
class Shard:
    """A contiguous range of rows ``[start, stop)``: the unit of work, retry and resume."""

    index: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def plan(n_rows: int, shard_size: int) -> list[Shard]:
    """Split ``n_rows`` rows into shards of ``shard_size`` rows (the last may be shorter)."""
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    return [
        Shard(i, start, min(start + shard_size, n_rows))
        for i, start in enumerate(range(0, n_rows, shard_size))
    ]


_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")  # no "+": "+1"/"-1" stay two class names, as before


def missing_label(value: object) -> bool:
    """No label: none, an empty text, or a float NaN (pandas' missing value: an integer column with gaps is
    written as floats)."""
    return value is None or value == "" or (isinstance(value, float) and value != value)


def label_number(value: object) -> Decimal | None:
    """A label read as a number: a JSON int or float, or text such as ``3``, ``3.0``, ``1e1``
    (what pandas writes for an integer column with gaps); None for a class name."""
    if isinstance(value, bool):  # JSON true/false: names, as before
        return None
    if isinstance(value, int | float):
        return Decimal(value)  # exact; NaN and infinities included, refused by the caller
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return Decimal(value.strip())
    return None


def whole_number(d: Decimal) -> bool:
    """A label's number (a Decimal) is a class index: finite, whole, an int64."""
    return bool(d.is_finite() and d == d.to_integral_value() and -(2**63) <= d < 2**63)


def labels_of(raw: Iterable[object],
              where: Callable[[int], str] = lambda n: f"row {n + 1}") -> tuple[np.ndarray, list[str]]:
    """Integer labels as given, or class names mapped to sorted indices; -1 where missing.

    Numbers are class indices when every present value is a whole number: ``3``, ``3.0`` and
    JSON ``3.0`` are all label 3. Otherwise every value is a class name (``"3"`` beside
    ``"cat"``); when all of them looked like numbers (``2.5``), with a warning naming
    ``where(row)`` of the first that is not whole. Decided on the distinct values: the rows keep a code each.
    """
    return labels_of_codes(*distinct(raw), where)


def labels_of_codes(codes: np.ndarray, values: list[object], firsts: list[int],
                    where: Callable[[int], str] = lambda n: f"row {n + 1}") -> tuple[np.ndarray, list[str]]:
    """:func:`labels_of` from each row's code into the distinct raw values, and the first row of each
    (:func:`distinct`'s, or a reader's that finds them in bulk)."""
    present = [k for k, v in enumerate(values) if not missing_label(v)]
    table = np.full(len(values), -1, dtype=np.int64)
    if not present:
        return looked_up(table, codes), []
    numbers = {k: d for k in present if (d := label_number(values[k])) is not None}
    if len(numbers) == len(present):
        odd = [k for k, d in numbers.items() if not whole_number(d)]
        if not odd:
            for k, d in numbers.items():
                table[k] = int(d)
            return looked_up(table, codes), []
        first = min(odd, key=firsts.__getitem__)
        log.warning("%s: label %r is not a whole number, so every label is taken as a class name (class indices "
                    "are whole numbers: 3, or 3.0 as spreadsheets write it)", where(firsts[first]), values[first])
    classes = sorted({str(values[k]) for k in present})
    index = {c: i for i, c in enumerate(classes)}
    for k in present:
        table[k] = index[str(values[k])]
    return looked_up(table, codes), classes


def _large_string_id() -> int:
    import pyarrow as pa

    return int(pa.large_string().id)


def distinct(raw: Iterable[object]) -> tuple[np.ndarray, list[object], list[int]]:
    """Each row's code into its distinct values (by type and value: ``1`` and ``True`` differ), the values, and
    the first row of each."""
    found = Distinct()
    found.add(raw)
    return found.result()


class Distinct:
    """:func:`distinct` built a block at a time: Python values one by one, or an Arrow array's in bulk (its
    distinct values found by Arrow, a few made Python values)."""

    def __init__(self) -> None:
        self.codes = Column("i")  # (int32: half of int64's bytes; on the disk past a megabyte)
        self.index: dict[tuple[type, object], int] = {}
        self.values: list[object] = []
        self.firsts: list[int] = []
        self.texts: dict[str, int] = {}  # the str values' codes (most labels: no key to make)
        self.arrow: dict[str, tuple[Any, np.ndarray]] = {}  # by Arrow type: the values seen, and their codes

    def _code(self, v: object, n: int) -> int:
        if type(v) is str:
            code = self.texts.get(v)
            if code is None:
                code = self.texts[v] = self._new((str, v), v, n)
            return code
        key = (type(v), v if isinstance(v, str | int | float | None) else repr(v))
        code = self.index.get(key)
        return self._new(key, v, n) if code is None else code

    def _new(self, key: tuple[type, object], v: object, n: int) -> int:
        code = self.index[key] = len(self.values)
        self.values.append(v)
        self.firsts.append(n)
        return code

    def add(self, raw: Iterable[object]) -> None:
        """Values one by one."""
        code, block = self._code, array("i")
        for n, v in enumerate(raw, len(self.codes)):
            block.append(code(v, n))
            if len(block) == BLOCK:
                self.codes.extend(block)
                block = array("i")
        self.codes.extend(block)

    def add_coded(self, values: Sequence[object], codes: np.ndarray) -> None:
        """Values given as the distinct ones and each row's code into them (a reader's that found them in bulk)."""
        present, first_at = np.unique(codes, return_index=True)  # the values rows have, and the first row of each
        table = np.full(len(values), -1, dtype=np.int32)
        at = len(self.codes)
        table[present] = [self._code(values[k], at + f) for k, f in zip(present.tolist(), first_at.tolist(),
                                                                       strict=True)]
        self.codes.extend(table[codes])

    def add_arrow(self, column: Any) -> None:
        """An Arrow array's values (a null: None), their distinct values found in bulk."""
        if not len(column):
            return
        import pyarrow as pa

        column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
        if pa.types.is_dictionary(column.type):  # its dictionary may hold values no row has
            column = column.cast(column.type.value_type)
        try:
            encoded = column.dictionary_encode(null_encoding="encode")
            in_block = encoded.indices.to_numpy(zero_copy_only=False)
            table = self._arrow_codes(encoded.dictionary, in_block)
        except pa.ArrowNotImplementedError:  # lists, structs, half floats, views...: made Python values
            self.add(column.to_pylist())
            return
        self.codes.extend(table[in_block])

    def _arrow_codes(self, values: Any, in_block: np.ndarray) -> np.ndarray:
        """The codes of a block's distinct values (an Arrow array): those seen in earlier blocks of this type
        looked up by Arrow, the new ones given codes (their first row: where the block has them first)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        kind = str(values.type)
        seen, codes = self.arrow.get(kind, (pa.array([], values.type), np.zeros(0, dtype=np.int32)))
        at = pc.fill_null(pc.index_in(values, value_set=seen), -1).to_numpy(zero_copy_only=False)
        table = np.append(codes, -1).astype(np.int32)[at]  # (-1: a value not seen, given its code below)
        new = np.flatnonzero(at < 0)
        if len(new):
            _, first_at = np.unique(in_block, return_index=True)  # each distinct value's first row in the block
            fresh = values.take(pa.array(new))
            table[new] = [self._code(v, len(self.codes) + int(first_at[k]))
                          for k, v in zip(new.tolist(), fresh.to_pylist(), strict=True)]
            self.arrow[kind] = (pa.concat_arrays([seen, fresh]), np.concatenate([codes, table[new]]))
        return table

    def result(self) -> tuple[np.ndarray, list[object], list[int]]:
        """Each row's code, the distinct values, the first row of each (the builder is done with)."""
        return self.codes.array(), self.values, self.firsts


class ClassCodes:
    """A listing's labels made class indices as they are read (a listing streamed), each decided alone as
    :func:`labels_of` and :func:`named` decide them once every label is read: with ``classes`` (data.classes, none
    of whose names reads as a number: :meth:`usable`), a label is an index where it is a number and a name there
    where it is not; without, every label is an index (a name cannot be numbered before all are read: refused,
    saying to name the classes). What a listing made whole refuses at its end is refused where it is first read,
    ``where(row)`` naming it: a name not in data.classes, a number that is none of its indices (0 to n - 1, or -1:
    none; any whole number without data.classes), numbers beside names."""

    def __init__(self, classes: list[str] | None, where: Callable[[int], str]) -> None:
        self.classes, self.where = classes, where
        self.names = {c: i for i, c in enumerate(classes or [])}
        self.first: dict[bool, tuple[int, object]] = {}  # whether a number: the first row with such a label, and it

    @staticmethod
    def usable(classes: Sequence[str] | None) -> bool:
        """Whether labels can be coded as read with these classes: none given, or none that reads as a number."""
        return classes is None or not any(label_number(c) is not None for c in classes)

    def table(self, values: Sequence[object], firsts: Sequence[int]) -> np.ndarray:
        """The class index (int64; -1: none) of each of a block's distinct raw labels ``values``, the first row of
        each ``firsts``."""
        out = np.full(len(values), -1, dtype=np.int64)
        for k, v in enumerate(values):
            if missing_label(v):
                continue
            number = label_number(v)
            self.first.setdefault(number is not None, (firsts[k], v))
            out[k] = self._index(v, number, firsts[k])
        if len(self.first) == 2:
            (n, index), (m, name) = self.first[True], self.first[False]
            raise DataError(f"labels are class indices ({self.where(n)}: {index!r}) and class names ({self.where(m)}: "
                            f"{name!r}); make every label an index of data.classes or every one a name there")
        return out

    def _index(self, v: object, number: Decimal | None, row: int) -> int:
        n = len(self.names)
        if number is not None and whole_number(number) and (self.classes is None or -1 <= number < n):
            return int(number)
        if number is None and str(v) in self.names:
            return self.names[str(v)]
        if self.classes is None:  # (a number that is not whole makes every label a name, as a name does)
            raise late_name(f"{self.where(row)}: label {v!r} is a class name")
        if number is None:
            raise DataError(f"{self.where(row)}: label {v!r} is not in data.classes ({n} names); add it, or remove "
                            "data.classes to take the labels' own names")
        raise DataError(f"{self.where(row)}: label {v!r} is none of data.classes' indices (0 to {n - 1}, or -1: "
                        "none) nor a name there; fix the label or data.classes")


def first_name(rows: Rows) -> tuple[int, bool] | None:
    """The first row whose label is a class name that is not a class index (as :func:`labels_of` made every label
    a name: ``rows.classes``), and whether every class is such a name (else indices and names were mixed); None:
    the rows have no classes."""
    names = [k for k, c in enumerate(rows.classes) if (d := label_number(c)) is None or not whole_number(d)]
    row = first_where(rows.labels, lambda block: np.isin(block, names)) if names else None
    return None if row is None else (row, len(names) == len(rows.classes))


def late_name(what: str) -> RemakeError:
    """The error of a listing streamed without data.classes, its labels taken as class indices as they came (the
    store's so far), that reads a class name (``what``: the label and its row): names are numbered once every label
    is read, so the store is made again with the classes listed."""
    return RemakeError(f"{what}, and names are numbered once every label is read; list the classes' names in "
                       "data.classes to take them as they come", "labels taken as class indices (data.classes not "
                       "given)")


def first_where(values: np.ndarray, test: Callable[[np.ndarray], np.ndarray]) -> int | None:
    """The first index where ``test`` of a block of ``values`` is true, a block at a time; None: nowhere."""
    for start in range(0, len(values), BLOCK):
        hits = np.flatnonzero(test(values[start:start + BLOCK]))
        if len(hits):
            return start + int(hits[0])
    return None


def looked_up(table: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``table[codes]``, a block at a time into a spilled column (int64 labels of 400M rows: 3.2 GB)."""
    out = Column("q")
    for start in range(0, len(codes), BLOCK):
        out.extend(table[codes[start:start + BLOCK]])
    return out.array()


def named(rows: Rows, classes: list[str], where: str, what: str = "data.classes") -> Rows:
    """``rows`` with the class names ``data.classes`` (``what`` names them): integer labels checked to be among
    them (0 to n - 1, or -1: none), labels that were names (or folders) given their index in them."""
    labels = rows.labels
    if rows.classes:  # names: their index in the given list
        index = {c: i for i, c in enumerate(classes)}
        unknown = sorted(set(rows.classes) - set(index))
        known = [c for c in rows.classes if c in index]
        if unknown and known and all(label_number(c) is not None for c in unknown):  # (their numbers made names)
            raise DataError(f"{where}: labels are class indices ({', '.join(map(repr, unknown[:5]))}) and class names "
                            f"({', '.join(map(repr, known[:5]))}); make every label an index of {what} or every one "
                            "a name there")
        if unknown:
            raise DataError(f"{where}: labels {', '.join(map(repr, unknown[:10]))} are not in data.classes "
                            f"({len(classes)} names); add them, or remove data.classes to take the labels' own names")
        to = np.asarray([index[c] for c in rows.classes], dtype=np.int64)
        labels = looked_up(np.append(to, -1), labels)  # (-1, none, stays -1)
    else:
        first = first_where(labels, lambda block: (block >= len(classes)) | (block < -1))
        if first is not None:
            raise DataError(f"{where}: row {rows.ids[first]!r} has label {labels[first]}, but {what} names "
                            f"{len(classes)} classes (labels 0 to {len(classes) - 1}, or -1: none)")
    return replace(rows, labels=labels, classes=classes)
