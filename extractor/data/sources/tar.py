"""WebDataset-style tar shards: brace patterns, planning rows from tar headers.

A sample is the group of members sharing a key (the member path up to the first dot of its
file name); its image is the member with an image extension, its label the content of a
``.cls`` member (an integer or a class name) or the ``label`` field of a ``.json`` member.
Planning reads only headers (and the small label members), in parallel over tars, so rows
are known and deterministic before any image is decoded; each row records its image's
byte offset and size so workers read just those bytes.

A row's stored path is ``TAR_URL#MEMBER``. Both parts may contain ``#`` (a folder
``run#1``, a member ``a#1.jpg``), so the tar URL is the part before the first ``#`` at
which an existing file ends (:func:`tar_url_of`); listing refuses a tar whose path would
make that ambiguous. Local tar paths are stored absolute.
"""

from __future__ import annotations

import bisect
import io
import itertools
import json
import logging
import mmap
import os
import re
import tarfile
import zlib
from array import array
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..._threads import prefetched
from ...errors import DataError
from ..files import (
    absolute,
    check_unambiguous,
    is_url,
    local_fingerprint,
    member_fingerprints,
    remote_error,
    remote_fingerprint,
    tar_url_of,
)
from ..rows import Joining, Rows, Strings, duplicate, labels_of

__all__ = ["Samples", "expand_braces", "list_tars", "scan_tar", "tar_listing", "tar_url_of"]

log = logging.getLogger(__name__)

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}|\{([^{}]*,[^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> a-000.tar, a-001.tar, a-002.tar; ``{x,y}`` alternatives too."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    if m.group(3) is not None:
        options = m.group(3).split(",")
    else:
        lo, hi = m.group(1), m.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        step = 1 if int(hi) >= int(lo) else -1
        options = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
    head, tail = pattern[: m.start()], pattern[m.end():]
    return list(itertools.chain.from_iterable(expand_braces(head + o + tail) for o in options))


def _key_and_ext(name: str) -> tuple[str, str]:
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    return (name, "") if dot < 0 else (name[:dot], name[dot:].lower())


@dataclass
class Samples:
    """A tar's samples with an image, in the order of their first member, as columns: key, image member, its
    data offset and size, raw label (None: none)."""

    keys: list[str] = field(default_factory=list)
    members: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)


def scan_tar(url: str, extensions: Sequence[str], storage_options: dict[str, Any]) -> Samples:
    """The samples of one tar that have an image (key, member, offset, size, raw label)."""
    fobj = _open_tar(url, storage_options)
    try:
        try:
            members = list(_headers(fobj, url))
        except _Unusual:  # a sparse or vendor member: tarfile reads what the plain header reader does not
            fobj.seek(0)
            with tarfile.open(fileobj=fobj, mode="r:") as tar:
                members = [(m.name, m.offset_data, m.size) for m in _members(tar, url) if m.isfile()]
        samples, keys = _samples(members, fobj, tuple(e.lower() for e in extensions), url)
    except tarfile.TarError as err:
        raise DataError(f"tar shard {url} is not a readable tar file ({type(err).__name__}: {err})") from None
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001
        raise remote_error("tar shard", url, err) from err
    finally:
        fobj.close()
    if not samples:
        names = ", ".join(keys[:5]) or "no members"
        raise DataError(f"tar shard {url} holds no image members (keys: {names}); check data.extensions")
    return samples


def _samples(members: Sequence[tuple[str, int, int]], fobj: Any, exts: tuple[str, ...],
             url: str) -> tuple[Samples, list[str]]:
    """The tar's samples with an image, in the order of their first member (the labels read from the small
    ``.cls`` and ``.json`` members), and every key seen. Columns, not a dict a sample: planning a million
    samples spent a fifth of its time making and reading them."""
    found: dict[str, list[Any]] = {}  # key -> [member, offset, size, label]
    for name, offset, size in members:
        key, ext = _key_and_ext(name)
        rec = found.get(key)
        if rec is None:
            rec = found[key] = [None, 0, 0, _NO_LABEL]
        if ext.endswith(exts):
            if rec[0] is not None:
                raise DataError(f"tar shard {url}: sample {key!r} has two images, {rec[0]} and {name}: a key names one "
                                "sample and its one image; give each image its own key, or set data.extensions to "
                                "the one to read")
            rec[0], rec[1], rec[2] = name, offset, size
        elif ext in (".cls", ".json") and size < 1 << 20:
            rec[3] = _read_label(_read_at(fobj, offset, size), ext, rec[3])
    out = Samples()
    for key, (member, offset, size, label) in found.items():
        if member is not None:
            out.keys.append(key)
            out.members.append(member)
            out.offsets.append(offset)
            out.sizes.append(size)
            out.labels.append(None if label is _NO_LABEL else label)
    return out, list(found)


_NO_LABEL = object()  # no .cls or .json label read yet (None: a .json label that is null)


class _Unusual(Exception):
    """A member the plain header reader leaves to tarfile."""


_BLOCK = 512
_FILES = (b"0", b"\0", b"7")  # regular file, old regular file, contiguous file
_NOT_FILES = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, FIFOs
_EXTENDED = (b"L", b"K", b"x", b"g")  # GNU long name and link name, pax extended and global headers


def _headers(f: Any, url: str) -> Iterator[tuple[str, int, int]]:
    """``(name, data offset, size)`` of each regular file of the tar ``f``, as tarfile lists them: 512-byte
    ustar/GNU headers, GNU long names (``L``), pax extended and global headers (``path``, ``size``) applied,
    no Python object per member (tarfile's TarInfo costs ~58 us a member). A tar cut short ends the listing,
    as :func:`_members` does; a bad first header is a TarError; anything else raises _Unusual."""
    pos, count = 0, 0
    pending = _Pending()
    while True:
        block = _read_at(f, pos, _BLOCK)
        if len(block) < _BLOCK or not _checksum_ok(block):
            _check_end(block, count, pos, url)
            return
        kind, size = block[156:157], _number(block[124:136])
        data = pos + _BLOCK
        if kind in _EXTENDED:
            pending.read(kind, _read_at(f, data, size))
            pos = data + -(-size // _BLOCK) * _BLOCK
            continue
        name, size = pending.apply(block, size)
        pos = data + -(-size // _BLOCK) * _BLOCK
        count += 1
        if kind in _FILES and not (kind == b"\0" and name.endswith("/")):
            yield name, data, size
        elif kind not in _NOT_FILES and kind != b"\0":
            raise _Unusual(kind)


def _read_at(f: Any, pos: int, size: int) -> bytes:
    """``size`` bytes of ``f`` at ``pos`` (fewer at its end): a slice of a mapped file, else a seek and a read."""
    if isinstance(f, mmap.mmap):
        return f[pos:pos + size]
    f.seek(pos)
    return f.read(size)


def _check_end(block: bytes, count: int, pos: int, url: str) -> None:
    """At a block that is no header: the end-of-archive mark, a tar cut short (a warning), or (first) no tar."""
    zeros = len(block) == _BLOCK and block.count(0) == _BLOCK
    if count == 0 and not zeros:  # (an archive of no members, as tarfile reads it, lists nothing)
        raise tarfile.ReadError("bad checksum" if block else "empty file")
    if block and not zeros:
        log.warning("tar shard %s ends early after %d members (no header at %d): truncated?", url, count, pos)


class _Pending:
    """What extended headers say of the next member (GNU long name, pax records) or of all (pax global)."""

    def __init__(self) -> None:
        self.long_name: str | None = None
        self.pax: dict[str, str] = {}
        self.glob: dict[str, str] = {}

    def read(self, kind: bytes, payload: bytes) -> None:
        if kind == b"L":
            self.long_name = payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind in (b"x", b"g"):
            (self.pax if kind == b"x" else self.glob).update(_pax(payload))

    def apply(self, block: bytes, size: int) -> tuple[str, int]:
        """The member's name and size: its header's, unless extended headers say otherwise."""
        if self.long_name is None and not self.pax and not self.glob:  # the plain member, most of them
            return _name(block), size
        fields = {**self.glob, **self.pax}
        if any(k.startswith("GNU.sparse") for k in fields):
            raise _Unusual("sparse")
        name = fields.get("path", self.long_name if self.long_name is not None else _name(block))
        self.long_name, self.pax = None, {}
        return name, int(fields.get("size", size))


def _number(field: bytes) -> int:
    """A header's number: octal text, or GNU base-256 (first byte 0x80 or 0xff)."""
    if field[0] in (0o200, 0o377):
        value = int.from_bytes(field[1:], "big")
        return value - (256 ** (len(field) - 1)) if field[0] == 0o377 else value
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(block: bytes) -> bool:
    """The header's checksum, unsigned (POSIX) or signed (old tars), as tarfile accepts it; an all-zero block
    (the end-of-archive mark) has none. The byte sum is adler32's low half (modulo 65521: the sum of a header
    is below 2 x 65521, so a match is exact up to one alias), the signed one summed only when that fails."""
    try:
        stored = _number(block[148:156])
    except ValueError:
        return False
    if ((zlib.adler32(block) & 0xFFFF) - 1 - sum(block[148:156]) + 256 - stored) % 65521 == 0:
        return block.count(0) < _BLOCK
    rest = block[:148] + b"        " + block[156:]
    return stored == sum(rest) - 256 * sum(b >= 128 for b in rest)


def _name(block: bytes) -> str:
    name = block[:100].split(b"\0", 1)[0]
    if block[257:263] == b"ustar\0":  # POSIX ustar: a prefix folder in its own field
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax(payload: bytes) -> dict[str, str]:
    """Records ``LENGTH KEY=VALUE\\n`` of a pax header."""
    out, at = {}, 0
    while at < len(payload):
        space = payload.find(b" ", at)
        if space < 0:
            break
        length = int(payload[at:space])
        key, _, value = payload[space + 1 : at + length - 1].partition(b"=")
        out[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        at += length
    return out


def _open_tar(url: str, storage_options: dict[str, Any]) -> Any:
    """The tar's file object, local or remote; a missing or unreadable one is a DataError."""
    try:
        if is_url(url):
            import fsspec

            return fsspec.open(url, "rb", **storage_options).open()
        with open(url.removeprefix("file://"), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return io.BytesIO(b"")  # (an empty file cannot be mapped)
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # headers read without a system call each
    except FileNotFoundError:
        raise DataError(f"tar shard {url} does not exist") from None
    except Exception as err:  # noqa: BLE001 - every backend raises its own errors
        raise remote_error("tar shard", url, err) from err


def _read_label(raw: bytes, ext: str, label: Any) -> Any:
    """A sample's label from its ``.cls`` member (the text), or its ``.json`` member's ``label``
    field when no label was found before (``label``: the one found before, or _NO_LABEL)."""
    text = raw.decode("utf-8", "replace").strip()
    if ext == ".cls":
        return text
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        meta = {}
    if isinstance(meta, dict) and "label" in meta and label is _NO_LABEL:
        return meta["label"]
    return label


def _members(tar: tarfile.TarFile, url: str):  # -> Iterator[tarfile.TarInfo]
    """The members of a tar; a tar cut short ends the listing (its last rows then fail on read)."""
    count = 0
    while True:
        try:
            member = tar.next()
        except tarfile.ReadError as err:
            if count == 0:
                raise
            log.warning("tar shard %s ends early after %d members (%s): truncated?", url, count, err)
            return
        if member is None:
            return
        count += 1
        yield member


def tar_urls(patterns: str | Sequence[str] | None) -> list[str]:
    """The tars that ``data.tars`` names, in order."""
    pats = [patterns] if isinstance(patterns, str) else list(patterns or [])
    urls = [absolute(u) for p in pats for u in expand_braces(p)]
    if not urls:
        raise DataError("data.tars names no tar shards")
    return urls


def tar_listing(patterns: str | Sequence[str] | None, extensions: Sequence[str],
                storage: dict[str, Any]) -> dict[str, Any]:
    """What a listing of the tars is made from: the tars, their fingerprints (size and mtime or ETag; 0 unknown),
    the extensions; a listing recorded with a store is good as long as this is the same."""
    urls = tar_urls(patterns)
    with ThreadPoolExecutor(min(16, len(urls))) as pool:
        prints = list(pool.map(lambda u: _tar_fingerprint(u, storage), urls))
    return {"tars": urls, "fingerprints": prints, "extensions": list(extensions)}


def list_tars(patterns: str | Sequence[str] | None, extensions: Sequence[str], storage: dict[str, Any]) -> Rows:
    """Rows of every sample of every tar, in pattern order then member order."""
    listing = tar_listing(patterns, extensions, storage)  # recorded with the store: a resume may reuse the rows
    urls, tar_prints = listing["tars"], listing["fingerprints"]
    for url in urls:
        if "#" in url:
            check_unambiguous(url, storage)
    # remote tars on 16 threads (their reads wait on the network); local ones on one: parsing holds the GIL,
    # and threads contending for it took twice the time of one
    ids, paths = Strings(), Joining(f"{url}#" for url in urls)
    offsets, sizes, prints = array("q"), array("q"), array("Q")
    starts: list[int] = []  # each tar's first row

    def labels() -> Iterator[Any]:
        """Each sample's raw label, as the tars are read: the other columns gathered on the way."""
        threads = min(16, len(urls)) if any(is_url(u) for u in urls) else 1
        # each tar's records taken as it comes, then let go (all of them held at once: 700 bytes a row)
        scanned = prefetched(urls, lambda u: scan_tar(u, extensions, storage), threads + 1, threads)
        for t, (found, tar_print) in enumerate(zip(scanned, tar_prints, strict=True)):
            starts.append(len(offsets))
            ids.extend(found.keys)
            paths.parts(t, found.members)
            offsets.extend(found.offsets)
            sizes.extend(found.sizes)
            prints.extend(member_fingerprints(tar_print, found.offsets, found.sizes) if tar_print else
                          [0] * len(found))
            yield from found.labels

    def tar_of(n: int) -> str:
        return urls[bisect.bisect_right(starts, n) - 1]

    codes, classes = labels_of(labels(), lambda n: f"tar shard {tar_of(n)}, sample {ids[n]!r}")
    keys = ids.array()
    twice = duplicate(keys)
    if twice is not None:
        raise DataError(f"sample key {keys[twice[0]]!r} appears in {tar_of(twice[0])} and {tar_of(twice[1])}; keys "
                        "must be unique")
    return Rows(ids=keys, paths=paths.joined(), labels=codes, classes=classes, offsets=_int64(offsets),
                sizes=_int64(sizes), fingerprints=np.frombuffer(prints, dtype=np.uint64), listing=listing)


def _int64(values: array) -> np.ndarray:
    return np.frombuffer(values, dtype=np.int64)


def _tar_fingerprint(url: str, storage: dict[str, Any]) -> int:
    """The tar's own fingerprint (a member's is it with the member's offset and size); 0 when unknown."""
    if not is_url(url):
        return local_fingerprint(url)
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url, **storage)
        return remote_fingerprint(fs.info(path))
    except Exception:  # noqa: BLE001 - read fine a moment ago: unknown, not an error
        return 0
