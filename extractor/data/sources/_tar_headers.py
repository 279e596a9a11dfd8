"""The tar source's header reader: a tar's regular-file members (name, data offset, size) read from its 512-byte
headers, without tarfile's objects (tarfile itself for the unusual members it alone reads)."""

from __future__ import annotations

import logging
import mmap
import tarfile
import zlib
from collections.abc import Iterator
from typing import Any

__all__ = ["_Unusual", "_headers", "_members", "_read_at"]

log = logging.getLogger(__name__)


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
