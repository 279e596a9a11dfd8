"""The tar source's fast path: a local tar's headers walked with one slice and one ``int()`` a member (compiled
where numba is, past a tar's first 1,024 headers), then checked, named and grouped into samples in bulk with numpy
(issue 39: planning at most 10 us a sample; issue 57: 2 us from the headers; the plain header reader, a Python loop
of about 6 us a member with the grouping, stays for what this one does not read).

Read here: ustar, GNU and v7 headers of regular files, folders and links, with ASCII names of at most 100 bytes
(no ustar prefix) and sizes written as 11 octal digits, as WebDataset writers and ``tarfile`` write them. Anything
else (GNU long names, pax headers, base-256 numbers, a vendor's member, a name or extension beyond ASCII) gives
None: the caller lists that tar with the plain reader, which tarfile backs in turn. tests/data/test_tar_fast.py
pins both to tarfile's listing.
"""

from __future__ import annotations

import mmap
import os
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ...errors import DataError
from ..rows import Texts
from ._tar_headers import _check_end, _checksum_ok, _number

Columns = dict[str, Any]  # each a list, but the keys (a Texts) and end_codes (an array)

__all__ = ["fast_samples"]

_BLOCK = 512
_CHUNK = 1 << 15  # headers gathered at a time (16 MB of them)
_PLAIN_KINDS = np.isin(np.arange(256), list(b"0\x007123456"))  # files; links, devices, folders, FIFOs (by byte)
_FILE_KINDS = np.isin(np.arange(256), list(b"0\x007"))  # regular, old regular, contiguous file
_SIZE_ENDS = np.isin(np.arange(256), list(b"\0 "))  # the size field's 12th byte, as tar writes it
_USTAR = np.frombuffer(b"\0ustar\0\0", np.uint64)[0]  # the header's bytes 256-263 where it is ustar's (257-262)
_USTAR_BYTES = np.frombuffer(b"\0\xff\xff\xff\xff\xff\xff\0", np.uint64)[0]
_COLUMN = np.arange(_BLOCK)


Label = Callable[[bytes, str, Any], Any]  # a label member's bytes, extension, the label so far -> the label


def fast_samples(mm: mmap.mmap, fd: int, exts: tuple[str, ...], url: str, label: Label,
                 none: object) -> tuple[Columns, list[str]] | None:
    """The tar's samples with an image, as :func:`._tar_headers` and the plain grouping give them (key, image
    member, data offset, size, raw label: columns by those names), and the first keys seen; or None: read it
    the plain way. ``mm`` maps the tar, ``fd`` is its open file; ``label`` reads a label member, ``none`` (no
    label yet) given first."""
    if not all(e.isascii() for e in exts):
        return None
    members = _members(mm, fd, url)
    if members is None:
        return None
    names, lengths, offsets, sizes, leading = members  # (leading: read with the headers by pread, else None)
    read_at = (lambda at, n: mm[at:at + n]) if leading is None else (lambda at, n: os.pread(fd, n, at))
    return _grouped(mm, names, lengths, offsets, sizes, leading, exts, url, label, none, read_at)


Part = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]  # (positions, header blocks, facts, firsts)


class _Walk:
    """A tar's headers, each next one found past the last one's data (the size read as its field's first 11 bytes;
    the 12th is checked in bulk), a part of at most ``_CHUNK`` at a time, up to the first block not read so (the
    end mark, the end of the file, or a header for the plain reader; ``stop``: where, once the parts are read).
    Each part: the headers' positions, their blocks, where the compiled walk read them (:func:`_walk_kernel`) each
    one's size, byte sum and name's length (rows of an array; else None: made in bulk), and where they were read
    by ``pread`` (:func:`_read`) the first ``_SHORT`` bytes of each one's data (else None). The first ``_PROBE``
    headers are read by ``pread``: where they took a read each ``_FAR`` bytes or more on average (large images),
    or are all the tar holds, the headers are read so, a part at a time, until a part took less a read; the rest
    are walked in the tar's mapping (no view of it kept between parts: one would keep it from closing)."""

    def __init__(self, mm: mmap.mmap, fd: int) -> None:
        self.mm, self.fd, self.stop = mm, fd, 0

    def parts(self) -> Iterator[Part]:
        size, starts, heads = len(self.mm), array("q"), bytearray()
        pos, reads = _read(self.fd, size, 0, starts, heads, _PROBE)
        if not starts or (len(starts) == _PROBE and pos / reads < _FAR):
            yield from self._mapped(0)
            return
        begin = 0
        while True:
            if len(starts) in (0, _PROBE):  # (a new part, or the probe's headers: read on to a part's end)
                pos, more = _read(self.fd, size, pos, starts, heads, _CHUNK - len(starts))
                reads += more
            rows = np.frombuffer(heads, np.uint8).reshape(-1, _HEAD)
            if starts:
                yield np.frombuffer(starts, np.int64).copy(), rows[:, :_BLOCK], None, rows[:, _BLOCK:]
            if len(starts) < _CHUNK or not reads or (pos - begin) / reads < _FAR:
                break  # (the tar's end; or headers near each other from here: walked in the mapping)
            starts, heads, begin, reads = array("q"), bytearray(), pos, 0
        if len(starts) < _CHUNK:
            self.stop = pos
        else:
            yield from self._mapped(pos)

    def _mapped(self, pos: int) -> Iterator[Part]:
        """The headers from ``pos`` walked in the mapping: by the interpreter, then (a tar of more than
        ``_INTERPRETED`` headers, where numba is) walked again from ``pos`` by the compiled walk, a part at a time;
        from a size field in a form it does not read, by the interpreter again."""
        starts = array("q")
        end = _walked(self.mm, pos, starts, _INTERPRETED)
        kernel = _walk_kernel() if len(starts) == _INTERPRETED else None
        n = _CHUNK if kernel is not None else 0
        while kernel is not None and n == _CHUNK:
            found = np.empty((4, _CHUNK), np.int64)  # (positions, sizes, sums, name lengths)
            data = np.frombuffer(self.mm, dtype=np.uint8)
            try:
                n, pos = kernel(data, pos, found)
            finally:
                del data  # (no view of the mapping outlives this: one would keep it from closing)
            if n:
                yield found[0, :n], _gathered(self.mm, found[0, :n]), found[1:, :n], None
            starts, end = array("q"), pos
        end = _walked(self.mm, end, starts)  # (the rest: all of it without the compiled walk)
        for at in range(0, len(starts), _CHUNK):
            part = np.frombuffer(starts, np.int64)[at:at + _CHUNK].copy()
            yield part, _gathered(self.mm, part), None, None
        self.stop = end


def _walked(mm: mmap.mmap, pos: int, starts: array, most: int = -1) -> int:
    """:class:`_Walk`'s walk from ``pos``, interpreted, adding to ``starts`` (at most ``most`` more; -1: no limit);
    where it stopped."""
    add, last = starts.append, len(mm) - _BLOCK
    while pos <= last and most:  # (the loop of a member: kept to a slice, an int() and an append)
        try:
            size = int(mm[pos + 124:pos + 135], 8)
        except ValueError:
            break
        if size < 0:
            break
        add(pos)
        pos += 1023 + size & -512  # the header, then the data to a whole block
        most -= 1
    return pos


def _read(fd: int, size: int, pos: int, starts: array, heads: bytearray, most: int = -1) -> tuple[int, int]:
    """:func:`_walked` by ``pread``, each header read with what follows it (``_WINDOW`` bytes at a time: a
    WebDataset sample's label member, its text and its image's header in one read), its first ``_HEAD`` bytes
    added to ``heads`` (zeros past the file's end). For headers far apart (issue 57): a tar not in the page cache
    is read a few KB a header, where a fault of the mapping reads ahead as far as the kernel's read-ahead goes
    (128 KB by default: about an image of that size; 8 MB on the machine measured, the whole tar); one in the
    page cache as small writes left it costs a fault a header (6 us here) and its unmapping (3 us). Returns where
    it stopped, and how many reads it made."""
    add, pread, last, reads = starts.append, os.pread, size - _BLOCK, 0
    buf, base = b"", pos
    while pos <= last and most:  # (the loop of a member: a slice, an int(), an append and a copy)
        at = pos - base
        if at + _HEAD > len(buf):
            buf, base, at, reads = pread(fd, _WINDOW, pos), pos, 0, reads + 1
            if pos + len(buf) >= size:
                buf += bytes(_HEAD)
            elif len(buf) < _HEAD:
                break  # (a short read inside the file: the plain reader reads from here)
        try:
            length = int(buf[at + 124:at + 135], 8)
        except ValueError:
            break
        if length < 0:
            break
        add(pos)
        heads += buf[at:at + _HEAD]
        pos += 1023 + length & -512
        most -= 1
    return pos, reads


_WINDOW = 2048  # bytes a pread reads (2,048 measured quicker than 1,024 or 4,096 for WebDataset's samples)
_SHORT = 64  # label members of at most this many bytes are read in bulk
_HEAD = _BLOCK + _SHORT  # a header and the first bytes of its data, as the pread walk keeps them
_PROBE = 64  # headers read by pread first: the bytes they took a read decide how the rest are read
_FAR = 32_768  # mean bytes a read of the first headers from which the rest are read by pread: a WebDataset sample
# of 32 KB or more (its .cls and its image's header in one read), img2dataset's of 64 KB (.jpg, then .json and .txt).
# 100 KB images (`make bench`'s large tars): not in the page cache 113 us a sample, 23 MB read (mapped: 533 us,
# 412 MB); in it as read-ahead left it 6.6 us (mapped: 5.7), as small writes left it 7.7 (mapped: 16.5).
_INTERPRETED = 1024  # headers walked by the interpreter first: a tar of more is walked again, compiled
_KERNEL: list[Any] = []  # the compiled walk, once made (None without numba)


def _walk_kernel() -> Any:
    """The compiled walk, where numba is (the ``index`` extra; None without): ``(data, pos, out)`` fills the rows
    of ``out`` with the position, size, byte sum and name length (to the first zero byte of 100) of each header
    from ``pos`` whose size field is 11 octal digits (as ``int(field, 8)`` reads them), up to ``out``'s width;
    returns how many, and where it stopped. The interpreted walk is about 0.45 us a member (0.9 of a WebDataset
    sample's 3.6 us, issue 57), the bulk sums and name lengths 0.3 us a sample; this one reads each header once, in
    about 0.05 us, the pages it reads the same."""
    if not _KERNEL:
        try:
            _KERNEL.append(_compiled())
        except Exception:  # noqa: BLE001 - no numba, a numba that does not load or compile, or no folder for its
            _KERNEL.append(None)  # cache: the walk interpreted (an optional extra never stops a listing)
    return _KERNEL[0]


def _compiled() -> Any:
    """:func:`_walk_kernel`'s compiled walk, compiled now for a mapped file's bytes (read-only; cached beside this
    module, or in the user's cache folder)."""
    import numba

    if getattr(numba.config, "DISABLE_JIT", False):  # (NUMBA_DISABLE_JIT=1: the loop below interpreted, a byte at
        raise RuntimeError("numba's compiler is off")  # a time, is 50 times slower than the interpreted walk)

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def size_at(data: Any, pos: int) -> int:  # the size field's first 11 bytes as octal digits; -1: not so
        size = 0
        for k in range(pos + 124, pos + 135):
            digit = int(data[k]) - 48
            if digit < 0 or digit > 7:
                return -1
            size = size * 8 + digit
        return size

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def walk(data: Any, pos: int, out: Any) -> tuple[int, int]:
        n, last = 0, len(data) - _BLOCK
        while pos <= last and n < out.shape[1]:
            size = size_at(data, pos)
            if size < 0:
                break
            out[0, n], out[1, n] = pos, size
            n += 1
            pos += 1023 + size & -512
        for i in range(n):  # (summed as unsigned numbers, apart from the walk: 15 times as quick)
            block, total, name = data[out[0, i]:out[0, i] + _BLOCK], np.uint32(0), 100
            for k in range(_BLOCK):
                total += block[k]
            for k in range(100):
                if block[k] == 0:
                    name = k
                    break
            out[2, i], out[3, i] = total, name
        return n, pos

    empty = np.zeros(_BLOCK, np.uint8)
    empty.flags.writeable = False  # (as a mapping's bytes are: the type it is compiled for)
    walk(empty, 0, np.zeros((4, 1), np.int64))
    return walk


Members = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]


def _members(mm: mmap.mmap, fd: int, url: str) -> Members | None:
    """The regular files' names (bytes, a row as wide as the longest, zero past the name), their lengths, data
    offsets and sizes, and where the walk read any by ``pread`` the first ``_SHORT`` bytes of their data (else
    None); None: a header this path does not read. A block that is no header ends the listing as the plain
    reader's does."""
    walk, seen = _Walk(mm, fd), 0
    names, lengths, offsets, kept, firsts = [], [], [], [], []
    for starts, block, facts, first in walk.parts():
        bad = np.flatnonzero(~_checksums_ok(block, None if facts is None else facts[1]))
        if len(bad):  # the listing ends at the first block that is no header
            block = block[:int(bad[0])]
        sizes = _octal(block[:, 124:136], 11, None if facts is None else facts[0][:len(block)])  # as the walk read
        files = _plain(block, sizes, None if facts is None else facts[2][:len(block)])
        if files is None:
            return None
        seen += len(block)
        names.append(files[0])
        lengths.append(files[1])
        offsets.append(starts[files[2]] + _BLOCK)
        kept.append(sizes[files[2]])
        firsts.append(None if first is None else first[files[2]])
        if len(bad):
            walk.stop = int(starts[bad[0]])
            break
    end = bytes(mm[walk.stop:walk.stop + _BLOCK])
    if len(end) == _BLOCK and _checksum_ok(end):
        return None  # a header whose size field is not 11 octal digits: the plain reader reads it
    _check_end(end, seen, walk.stop, url)
    return _joined(mm, names, lengths, offsets, kept, firsts)


def _joined(mm: mmap.mmap, names: list[np.ndarray], lengths: list[np.ndarray], offsets: list[np.ndarray],
            sizes: list[np.ndarray], firsts: list[np.ndarray | None]) -> Members:
    """:func:`_members`' parts joined; their data's first bytes where a part's were read by ``pread`` (those of a
    part walked in the mapping then gathered from it)."""
    if not names:
        return np.zeros((0, 1), np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), None
    width = max(n.shape[1] for n in names)
    first = None if all(f is None for f in firsts) else np.concatenate(
        [_bytes_at(mm, o, _SHORT) if f is None else f for o, f in zip(offsets, firsts, strict=True)])
    return (np.concatenate([np.pad(n, ((0, 0), (0, width - n.shape[1]))) for n in names]), np.concatenate(lengths),
            np.concatenate(offsets), np.concatenate(sizes), first)


def _gathered(mm: mmap.mmap, starts: np.ndarray) -> np.ndarray:
    """The 512-byte blocks at ``starts`` (each a multiple of 512), copied: no view of the mapping outlives this
    (one would keep it from closing, an error's traceback included)."""
    blocks = np.frombuffer(mm, dtype=np.uint8)[:len(mm) // _BLOCK * _BLOCK].reshape(-1, _BLOCK)
    return blocks[starts // _BLOCK]


def _plain(block: np.ndarray, sizes: np.ndarray, cut: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Of checked headers (``cut``: their names' lengths, where the walk found them): the regular files' names
    (rows as wide as the longest, zero past the name), their lengths, and which they are; None where one is not
    plain (an extended or vendor header, a name past 100 bytes or beyond ASCII, a size field of 12 digits or a
    negative one)."""
    kinds = block[:, 156]
    if not _PLAIN_KINDS[kinds].all() or (sizes < 0).any() or not _SIZE_ENDS[block[:, 135]].all():
        return None
    cut = _first_zero(block[:, :100]) if cut is None else cut
    names = block[:, :max(int(cut.max(initial=0)), 1)].copy()  # as wide as the longest: names are short
    names[_COLUMN[:names.shape[1]] >= cut[:, None]] = 0
    ustar = (block.view(np.uint64)[:, 32] & _USTAR_BYTES) == _USTAR  # (rows of 512 bytes: 64 numbers)
    if (ustar & (block[:, 345] != 0)).any() or (names >= 128).any():
        return None  # a ustar prefix folder; a name beyond ASCII
    last = names[np.arange(len(names)), np.maximum(cut - 1, 0)]
    files = _FILE_KINDS[kinds] & ~((kinds == 0) & (last == ord("/")) & (cut > 0))
    return names[files], cut[files], np.flatnonzero(files)


def _first_zero(rows: np.ndarray) -> np.ndarray:
    """Each row's first zero byte (the row's width where none)."""
    zero = rows == 0
    return np.where(zero.any(1), zero.argmax(1), rows.shape[1])


def _checksums_ok(block: np.ndarray, sums: np.ndarray | None = None) -> np.ndarray:
    """Of each header: its checksum is its bytes' sum (``sums``, where the walk made them), unsigned (POSIX) or
    signed (old tars), the checksum field taken as spaces, as tarfile accepts it; an all-zero block (the end mark)
    has none."""
    field = block[:, 148:156]
    stored = _octal(field, 6)
    if sums is None:
        sums = block.sum(1, dtype=np.uint32)
    ok = stored == sums.astype(np.int64) - field.sum(1, dtype=np.int64) + 256
    for i in np.flatnonzero(~ok).tolist():  # the signed sum, of the few that the unsigned one fails
        signed = block[i].view(np.int8).sum(dtype=np.int64) - field[i].view(np.int8).sum(dtype=np.int64) + 256
        ok[i] = stored[i] == signed and block[i].any()
    return ok


def _octal(field: np.ndarray, digits: int, read: np.ndarray | None = None) -> np.ndarray:
    """Numbers of header fields as tarfile reads them (text to the first NUL, spaces around octal digits); the
    odd ones (base-256, other text) read one by one as the plain reader does; -1 where none is read. ``read``:
    the first ``digits`` of each field, known to be octal digits, read (by the compiled walk)."""
    if read is None:
        values = field[:, :digits].astype(np.int64) - ord("0")
        common = ((values >= 0) & (values <= 7)).all(1) & (field[:, digits] == 0)  # "%0{digits}o\0": as tar writes
        out = values @ 8 ** np.arange(digits - 1, -1, -1, dtype=np.int64)
    else:
        common, out = field[:, digits] == 0, read.copy()
    if not common.all():
        odd = np.flatnonzero(~common)
        out[odd] = _octal_any(field[odd])
    return out


def _octal_any(field: np.ndarray) -> np.ndarray:
    """:func:`_octal` of fields in any form."""
    width = field.shape[1]
    cut = _first_zero(field)
    inside = _COLUMN[:width] < cut[:, None]
    digit = (field >= ord("0")) & (field <= ord("7")) & inside
    space = (field == ord(" ")) & inside
    last = np.where(digit, _COLUMN[:width], -1).max(1)
    first = np.where(digit, _COLUMN[:width], width).min(1)
    runs = np.where(digit.any(1), last - first + 1, 0)
    plain = ((digit | space) == inside).all(1) & (digit.sum(1) == runs)
    power = np.where(digit, 8 ** np.clip(last[:, None] - _COLUMN[:width], 0, width), 0)
    out = ((field.astype(np.int64) - ord("0")) * power).sum(1)
    for i in np.flatnonzero(~plain).tolist():
        try:
            out[i] = _number(field[i].tobytes())
        except ValueError:
            out[i] = -1
    return out


def _grouped(mm: mmap.mmap, names: np.ndarray, length: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
             firsts: np.ndarray | None, exts: tuple[str, ...], url: str, label: Label, none: object,
             read_at: Callable[[int, int], bytes]) -> tuple[Columns, list[str]]:
    """The members grouped into samples by key (the name up to the first dot of its file name), in the order of
    their first member: each sample's image (the member whose extension ends with one of ``exts``) and label (the
    text of its last ``.cls``, else the ``label`` of its first ``.json`` that has one), as the plain grouping.
    ``firsts``: each member's first bytes where the walk read them (else read from ``mm``); ``read_at(offset,
    size)``: a member's bytes."""
    width = names.shape[1]
    dots = names == ord(".")
    slashes = names[:, ::-1] == ord("/")
    if slashes.any():  # (the file name's first dot: past the last slash)
        dots &= _COLUMN[:width] > np.where(slashes.any(1), width - 1 - slashes.argmax(1), -1)[:, None]
    key_len = np.where(dots.any(1), dots.argmax(1), length)  # to the first dot of the file name
    keys = names.copy()
    keys[_COLUMN[:width] >= key_len[:, None]] = 0
    tails, ends = _tails(names, key_len, length)  # (each member's, and the few distinct ones: .jpg, .cls)
    image, cls, meta = _kinds(ends, exts)[:, tails]
    unique, first, group = _keys(keys.view(f"S{width}").ravel())
    chosen = _images(group, image, len(unique), names, unique, url)
    read = np.flatnonzero((cls | meta) & ~image & (sizes < 1 << 20))
    order = np.argsort(first, kind="stable") if (first[1:] < first[:-1]).any() else np.arange(len(first))
    samples = order[chosen[order] >= 0]
    member = chosen[samples]
    bulk = _short_labels(mm, group[read], offsets[read], sizes[read], cls[read], len(unique), label, none,
                         None if firsts is None else firsts[read])
    if bulk is None:  # the plain way: each label member read in member order
        labels: dict[int, Any] = {}
        for g, o, size, text in zip(group[read].tolist(), offsets[read].tolist(), sizes[read].tolist(),
                                    cls[read].tolist(), strict=True):
            labels[g] = label(read_at(o, size), ".cls" if text else ".json", labels.get(g, none))
        found, codes = [None if (was := labels.get(g, none)) is none else was for g in samples.tolist()], None
    else:
        found, codes = bulk[0], bulk[1][samples]
    used = np.zeros(len(ends), bool)
    used[tails[member]] = True  # (the images' ends only, in the same order)
    end_codes = (np.cumsum(used) - 1)[tails[member]]
    end_names = [ends[u].decode("ascii") for u in np.flatnonzero(used).tolist()]
    imageless = order[chosen[order] < 0]  # keys without an image member: not samples
    out = {"keys": _utf8(unique[samples]), "members": _texts(names[member].view(f"S{width}").ravel()),
           "offsets": offsets[member], "sizes": sizes[member], "labels": found,
           "label_codes": codes, "end_names": end_names, "end_codes": end_codes, "left_out": len(imageless),
           "left_out_key": unique[imageless[0]].decode("ascii") if len(imageless) else None}
    return out, [k.decode("ascii") for k in unique[order[:5]].tolist()]


def _keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(keys, return_index=True, return_inverse=True)``; without sorting where each key's members are
    adjacent and the keys in order (as WebDataset writers write them): runs of one key, each greater than the last."""
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)
    heads = keys[starts]
    if not (heads[1:] > heads[:-1]).all():
        unique, first, group = np.unique(keys, return_index=True, return_inverse=True)
        return unique, first, group.reshape(-1)
    return heads, starts, np.cumsum(np.r_[False, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)


def _utf8(names: np.ndarray) -> Texts:
    """ASCII names (a fixed-width bytes array, zeros after each) as a Texts: their bytes one after another, and
    where each ends (no ``str`` made: the listing takes them as they are)."""
    rows = names.view(np.uint8).reshape(len(names), -1) if len(names) else np.zeros((0, 1), np.uint8)
    length = _first_zero(rows)
    return Texts(rows[_COLUMN[:rows.shape[1]] < length[:, None]], np.cumsum(length, dtype=np.int64))


def _texts(names: np.ndarray) -> list[str]:
    """ASCII names (a bytes array; none holds a zero byte) as strings: joined, decoded and split at once."""
    return b"\0".join(names.tolist()).decode("ascii").split("\0") if len(names) else []


def _short_labels(mm: mmap.mmap, group: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, cls: np.ndarray,
                  n_groups: int, label: Label, none: object,
                  firsts: np.ndarray | None = None) -> tuple[list[Any], np.ndarray] | None:
    """The distinct labels (the last None: none) and each sample's code into them where every label member is a
    ``.cls`` of at most ``_SHORT`` bytes, none holding a zero byte, one at most a sample (WebDataset's): their bytes
    gathered at once (from ``firsts``, where the walk read them), ``label`` applied to each distinct text once.
    None: read them the plain way."""
    if not cls.all() or (sizes > _SHORT).any() or np.bincount(group, minlength=1).max() > 1:
        return None
    width = max(int(sizes.max(initial=0)), 1)
    raw = _bytes_at(mm, offsets, width) if firsts is None else firsts[:, :width].copy()
    inside = _COLUMN[:width] < sizes[:, None]
    if (inside & (raw == 0)).any():
        return None  # (a text's zero bytes would be cut by the bytes dtype)
    raw[~inside] = 0
    texts, codes = np.unique(raw.view(f"S{width}").ravel(), return_inverse=True)
    by_group = np.full(n_groups, len(texts), np.int64)  # (len(texts): no label)
    by_group[group] = codes.reshape(-1)
    return [label(t, ".cls", none) for t in texts.tolist()] + [None], by_group


def _bytes_at(mm: mmap.mmap, offsets: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` bytes at each offset (zero past the end of the file), copied: no view of the mapping outlives
    this."""
    data = np.frombuffer(mm, dtype=np.uint8)
    at = offsets[:, None] + _COLUMN[:width]
    out = data[np.minimum(at, len(data) - 1)]
    out[at >= len(data)] = 0
    return out


def _tails(names: np.ndarray, key_len: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
    """What follows the key in each member name (``.jpg``): each name's code into the distinct ones (in byte
    order), and those."""
    width = max(int((length - key_len).max(initial=0)), 1)
    at = key_len[:, None] + _COLUMN[:width]
    tails = np.take_along_axis(names, np.minimum(at, names.shape[1] - 1), 1)
    tails[at >= length[:, None]] = 0
    if width <= 8:  # (one number a tail, told apart a pass each: none holds a zero byte, each is zero-padded)
        packed = np.zeros((len(tails), 8), np.uint8)
        packed[:, :width] = tails
        distinct, codes = _few(packed.view(np.uint64).ravel())
        texts = [bytes(r).rstrip(b"\0") for r in distinct.view(np.uint8).reshape(-1, 8)]
    else:
        distinct, codes = np.unique(tails.view(f"S{width}").ravel(), return_inverse=True)
        texts = distinct.tolist()
    order = sorted(range(len(texts)), key=texts.__getitem__)  # (the listing's codes: in byte order, as ever)
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return rank[codes.reshape(-1)], [texts[i] for i in order]


def _kinds(ends: list[bytes], exts: tuple[str, ...]) -> np.ndarray:
    """Of each distinct end of a member name (what follows its key), whether it is an image's (ends with one of
    ``exts``), a ``.cls`` or a ``.json``, in any case: rows of an array."""
    lowered, images = [e.lower() for e in ends], tuple(x.lower().encode() for x in exts)
    return np.asarray([[e.endswith(images) for e in lowered], [e == b".cls" for e in lowered],
                       [e == b".json" for e in lowered]], bool).reshape(3, len(ends))


def _few(values: np.ndarray, most: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values (in no order) and each one's code into them: a pass for each where there are at most
    ``most`` (the ends of a tar's members: .jpg and .cls), else sorted by ``np.unique``."""
    codes, todo = np.zeros(len(values), np.int64), np.ones(len(values), bool)
    distinct: list[Any] = []
    while len(distinct) < most and todo.any():
        distinct.append(values[todo.argmax()])
        same = values == distinct[-1]
        codes[same] = len(distinct) - 1
        todo &= ~same
    if todo.any():
        found, inverse = np.unique(values, return_inverse=True)
        return found, inverse.reshape(-1)
    return np.asarray(distinct, values.dtype), codes


def _images(group: np.ndarray, image: np.ndarray, n_groups: int, names: np.ndarray, unique: np.ndarray,
            url: str) -> np.ndarray:
    """Each sample's image member (-1: none); a sample of two images is refused, naming the first two."""
    members = np.flatnonzero(image)
    owners = group[members]
    seen, first = np.unique(owners, return_index=True)
    if len(seen) < len(owners):
        again = np.ones(len(owners), bool)
        again[first] = False
        second = int(np.flatnonzero(again)[0])
        earlier = int(members[first[np.searchsorted(seen, owners[second])]])
        key = unique[owners[second]].decode("ascii")
        one, two = (names[m].tobytes().rstrip(b"\0").decode("ascii") for m in (earlier, int(members[second])))
        raise DataError(f"tar shard {url}: sample {key!r} has two images, {one} and {two}: a key names one sample "
                        "and its one image; give each image its own key, or set data.extensions to the one to read")
    chosen = np.full(n_groups, -1, np.int64)
    chosen[seen] = members[first]
    return chosen

