"""The tar source's fast path: a local tar's headers walked with one slice and one ``int()`` a member, then checked,
named and grouped into samples in bulk with numpy (issue 39: planning at most 10 us a sample; the plain header
reader, a Python loop of about 6 us a member with the grouping, stays for what this one does not read).

Read here: ustar, GNU and v7 headers of regular files, folders and links, with ASCII names of at most 100 bytes
(no ustar prefix) and sizes written as 11 octal digits, as WebDataset writers and ``tarfile`` write them. Anything
else (GNU long names, pax headers, base-256 numbers, a vendor's member, a name or extension beyond ASCII) gives
None: the caller lists that tar with the plain reader, which tarfile backs in turn. tests/data/test_tar_fast.py
pins both to tarfile's listing.
"""

from __future__ import annotations

import mmap
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import DataError
from ..rows import Texts
from ._tar_headers import _check_end, _checksum_ok, _number

Columns = dict[str, Any]  # each a list, but the keys (a Texts) and end_codes (an array)

__all__ = ["fast_samples"]

_BLOCK = 512
_CHUNK = 1 << 15  # headers gathered at a time (16 MB of them)
_PLAIN_KINDS = np.frombuffer(b"0\x007123456", dtype=np.uint8)  # files; links, devices, folders, FIFOs
_FILE_KINDS = np.frombuffer(b"0\x007", dtype=np.uint8)  # regular, old regular, contiguous file
_COLUMN = np.arange(_BLOCK)


Label = Callable[[bytes, str, Any], Any]  # a label member's bytes, extension, the label so far -> the label


def fast_samples(mm: mmap.mmap, exts: tuple[str, ...], url: str, label: Label,
                 none: object) -> tuple[Columns, list[str]] | None:
    """The tar's samples with an image, as :func:`._tar_headers` and the plain grouping give them (key, image
    member, data offset, size, raw label: columns by those names), and the first keys seen; or None: read it
    the plain way. ``label`` reads a label member, ``none`` (no label yet) given first."""
    if not all(e.isascii() for e in exts):
        return None
    members = _members(mm, url)
    if members is None:
        return None
    names, offsets, sizes = members
    return _grouped(mm, names, offsets, sizes, exts, url, label, none)


def _walk(mm: mmap.mmap) -> tuple[np.ndarray, int]:
    """Each header's position, each next header found past the last one's data (the size read as its field's
    first 11 bytes; the 12th is checked in bulk), up to the first block not read so: the end mark, the end of the
    file, or a header for the plain reader. Also where it stopped."""
    starts = array("q")
    add, pos, last = starts.append, 0, len(mm) - _BLOCK
    while pos <= last:  # (the loop of a member: kept to a slice, an int() and an append)
        try:
            size = int(mm[pos + 124:pos + 135], 8)
        except ValueError:
            break
        if size < 0:
            break
        add(pos)
        pos += 1023 + size & -512  # the header, then the data to a whole block
    return np.frombuffer(starts, np.int64) if starts else np.zeros(0, np.int64), pos


def _members(mm: mmap.mmap, url: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The regular files' names (bytes, a row of 100 each, zero past the name), data offsets and sizes; None:
    a header this path does not read. A block that is no header ends the listing as the plain reader's does."""
    starts, stop = _walk(mm)
    names, offsets, kept = [], [], []
    for at in range(0, len(starts), _CHUNK):
        block = _gathered(mm, starts[at:at + _CHUNK])
        bad = np.flatnonzero(~_checksums_ok(block))
        if len(bad):  # the listing ends at the first block that is no header
            first = int(bad[0])
            block = block[:first]
            stop = int(starts[at + first])
            starts = starts[:at + first]
        sizes = _octal(block[:, 124:136], 11)  # as the walk read them
        files = _plain(block, sizes)
        if files is None:
            return None
        names.append(files[0])
        offsets.append(starts[at:at + len(block)][files[1]] + _BLOCK)
        kept.append(sizes[files[1]])
        if len(bad):
            break
    end = bytes(mm[stop:stop + _BLOCK])
    if len(end) == _BLOCK and _checksum_ok(end):
        return None  # a header whose size field is not 11 octal digits: the plain reader reads it
    _check_end(end, len(starts), stop, url)
    if not names:
        return np.zeros((0, 1), np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
    width = max(n.shape[1] for n in names)
    names = [np.pad(n, ((0, 0), (0, width - n.shape[1]))) for n in names]
    return np.concatenate(names), np.concatenate(offsets), np.concatenate(kept)


def _gathered(mm: mmap.mmap, starts: np.ndarray) -> np.ndarray:
    """The 512-byte blocks at ``starts`` (each a multiple of 512), copied: no view of the mapping outlives this
    (one would keep it from closing, an error's traceback included)."""
    blocks = np.frombuffer(mm, dtype=np.uint8)[:len(mm) // _BLOCK * _BLOCK].reshape(-1, _BLOCK)
    return blocks[starts // _BLOCK]


def _plain(block: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Of checked headers: the regular files' names (rows of 100 bytes, zero past the name) and which they are;
    None where one is not plain (an extended or vendor header, a name past 100 bytes or beyond ASCII, a size
    field of 12 digits or a negative one)."""
    kinds = block[:, 156]
    if not np.isin(kinds, _PLAIN_KINDS).all() or (sizes < 0).any() or not np.isin(block[:, 135], (0, 32)).all():
        return None
    cut = _first_zero(block[:, :100])
    names = block[:, :max(int(cut.max(initial=0)), 1)].copy()  # as wide as the longest: names are short
    names[_COLUMN[:names.shape[1]] >= cut[:, None]] = 0
    ustar = (block[:, 257:263] == np.frombuffer(b"ustar\0", np.uint8)).all(1)
    if (ustar & (block[:, 345] != 0)).any() or (names >= 128).any():
        return None  # a ustar prefix folder; a name beyond ASCII
    last = names[np.arange(len(names)), np.maximum(cut - 1, 0)]
    files = np.isin(kinds, _FILE_KINDS) & ~((kinds == 0) & (last == ord("/")) & (cut > 0))
    return names[files], np.flatnonzero(files)


def _first_zero(rows: np.ndarray) -> np.ndarray:
    """Each row's first zero byte (the row's width where none)."""
    zero = rows == 0
    return np.where(zero.any(1), zero.argmax(1), rows.shape[1])


def _checksums_ok(block: np.ndarray) -> np.ndarray:
    """Of each header: its checksum is its bytes' sum, unsigned (POSIX) or signed (old tars), the checksum field
    taken as spaces, as tarfile accepts it; an all-zero block (the end mark) has none."""
    field = block[:, 148:156]
    stored = _octal(field, 6)
    ok = stored == block.sum(1, dtype=np.uint32).astype(np.int64) - field.sum(1, dtype=np.int64) + 256
    for i in np.flatnonzero(~ok).tolist():  # the signed sum, of the few that the unsigned one fails
        signed = block[i].view(np.int8).sum(dtype=np.int64) - field[i].view(np.int8).sum(dtype=np.int64) + 256
        ok[i] = stored[i] == signed and block[i].any()
    return ok


def _octal(field: np.ndarray, digits: int) -> np.ndarray:
    """Numbers of header fields as tarfile reads them (text to the first NUL, spaces around octal digits); the
    odd ones (base-256, other text) read one by one as the plain reader does; -1 where none is read."""
    values = field[:, :digits].astype(np.int64) - ord("0")
    common = ((values >= 0) & (values <= 7)).all(1) & (field[:, digits] == 0)  # "%0{digits}o\0": as tar writes
    out = values @ 8 ** np.arange(digits - 1, -1, -1, dtype=np.int64)
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


def _grouped(mm: mmap.mmap, names: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, exts: tuple[str, ...],
             url: str, label: Label, none: object) -> tuple[Columns, list[str]]:
    """The members grouped into samples by key (the name up to the first dot of its file name), in the order of
    their first member: each sample's image (the member whose extension ends with one of ``exts``) and label (the
    text of its last ``.cls``, else the ``label`` of its first ``.json`` that has one), as the plain grouping."""
    n, width = names.shape
    length = _first_zero(names) if n else np.zeros(0, np.int64)
    slashes = names[:, ::-1] == ord("/")
    slash = np.where(slashes.any(1), width - 1 - slashes.argmax(1), -1)  # the last
    dots = (names == ord(".")) & (_COLUMN[:width] > slash[:, None])
    key_len = np.where(dots.any(1), dots.argmax(1), length)  # to the first dot of the file name
    keys = names.copy()
    keys[_COLUMN[:width] >= key_len[:, None]] = 0
    lower = names + (((names >= ord("A")) & (names <= ord("Z"))) * 32).astype(np.uint8)
    image = np.zeros(n, bool)
    for ext in exts:
        image |= _ends_with(lower, length, length - key_len, ext.lower().encode())
    cls = _ends_with(lower, length, length - key_len, b".cls") & (length - key_len == 4)
    meta = _ends_with(lower, length, length - key_len, b".json") & (length - key_len == 5)
    unique, first, group = _keys(keys.view(f"S{width}").ravel())
    chosen = _images(group, image, len(unique), names, unique, url)
    read = np.flatnonzero((cls | meta) & ~image & (sizes < 1 << 20))
    order = np.argsort(first, kind="stable")
    samples = order[chosen[order] >= 0]
    member = chosen[samples]
    bulk = _short_labels(mm, group[read], offsets[read], sizes[read], cls[read], len(unique), label, none)
    if bulk is None:  # the plain way: each label member read in member order
        labels: dict[int, Any] = {}
        for g, o, size, text in zip(group[read].tolist(), offsets[read].tolist(), sizes[read].tolist(),
                                    cls[read].tolist(), strict=True):
            labels[g] = label(mm[o:o + size], ".cls" if text else ".json", labels.get(g, none))
        found, codes = [None if (was := labels.get(g, none)) is none else was for g in samples.tolist()], None
    else:
        found, codes = bulk[0], bulk[1][samples]
    end_names, end_codes = _ends(names[member], key_len[member], length[member])
    imageless = order[chosen[order] < 0]  # keys without an image member: not samples
    out = {"keys": _utf8(unique[samples]), "members": _texts(names[member].view(f"S{width}").ravel()),
           "offsets": offsets[member].tolist(), "sizes": sizes[member].tolist(), "labels": found,
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


_SHORT = 64  # label members of at most this many bytes are read in bulk


def _short_labels(mm: mmap.mmap, group: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, cls: np.ndarray,
                  n_groups: int, label: Label, none: object) -> tuple[list[Any], np.ndarray] | None:
    """The distinct labels (the last None: none) and each sample's code into them where every label member is a
    ``.cls`` of at most ``_SHORT`` bytes, none holding a zero byte, one at most a sample (WebDataset's): their bytes
    gathered at once, ``label`` applied to each distinct text once. None: read them the plain way."""
    if not cls.all() or (sizes > _SHORT).any() or np.bincount(group, minlength=1).max() > 1:
        return None
    width = max(int(sizes.max(initial=0)), 1)
    raw = _bytes_at(mm, offsets, width)
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


def _ends(names: np.ndarray, key_len: np.ndarray, length: np.ndarray) -> tuple[list[str], np.ndarray]:
    """What follows the key in each member name (``.jpg``): the distinct ones and each name's code into them."""
    width = names.shape[1]
    at = key_len[:, None] + _COLUMN[:width]
    tails = np.take_along_axis(names, np.minimum(at, width - 1), 1)
    tails[at >= length[:, None]] = 0
    distinct, codes = np.unique(tails.view(f"S{width}").ravel(), return_inverse=True)
    return [t.decode("ascii") for t in distinct.tolist()], codes.reshape(-1)


def _ends_with(lower: np.ndarray, length: np.ndarray, ext_len: np.ndarray, tail: bytes) -> np.ndarray:
    """Of each name (lower case, ``length`` bytes): its extension (its last ``ext_len`` bytes) ends with ``tail``."""
    m = len(tail)
    if m == 0:
        return np.ones(len(lower), bool)
    at = np.clip(length[:, None] - m + np.arange(m), 0, lower.shape[1] - 1)
    same = (np.take_along_axis(lower, at, 1) == np.frombuffer(tail, np.uint8)).all(1)
    return same & (ext_len >= m)


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

