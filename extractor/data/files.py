"""Where images are and how a file's bytes are read: local paths, URLs (fsspec), and their fingerprints.

A row's stored path is a local path (absolute), a URL, or a locator of its source's own (see
:mod:`extractor.data.sources`); file names that are not UTF-8 are stored hex-encoded (``fsbytes:``).
"""

from __future__ import annotations

import glob
import itertools
import os
import re
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import DataError

__all__ = [
    "Locator",
    "absolute",
    "content_digest",
    "display_name",
    "fingerprint",
    "is_relative",
    "is_url",
    "leaves_root",
    "local_fingerprint",
    "read_file",
    "read_file_printed",
    "remote_error",
    "remote_fingerprint",
    "storable_path",
]


def is_url(path: str) -> bool:
    """A remote location (``s3://``, ``gs://``, ``memory://``...); ``file://`` and plain paths are local."""
    return "://" in path and not path.startswith("file://")


def is_relative(path: str) -> bool:
    """A local path relative to the current directory (not a URL, not ``file://``, not absolute)."""
    return "://" not in path and not os.path.isabs(path)


def leaves_root(path: str) -> bool:
    """A path, named by a source's row (a manifest's, a table's), that leaves the folder it is relative to: absolute,
    a URL, or climbing out with ``..``. The one rule for every source: such a path is refused unless
    ``data.outside_root: true`` says the source's paths lead elsewhere by design."""
    if not is_relative(path):
        return True
    depth = 0
    for part in path.replace("\\", "/").split("/"):
        depth += -1 if part == ".." else 0 if part in ("", ".") else 1
        if depth < 0:
            return True
    return False


def absolute(path: str) -> str:
    """A local path made absolute (against the current directory), so that workers running
    elsewhere and later readers find the file; URLs (``s3://``, ``file://``...) unchanged."""
    return path if "://" in path else os.path.abspath(path)


def remote_error(what: str, url: str, err: BaseException) -> DataError:
    """A listing error from a remote file system as a DataError with a hint (credentials, bucket, endpoint)."""
    name = type(err).__name__
    hint = ""
    text = str(err).lower()
    if "credential" in text or "access denied" in text or "forbidden" in text or "signature" in text:
        hint = "; check the credentials in data.storage_options"
    elif "bucket" in text or isinstance(err, FileNotFoundError):
        hint = "; check the bucket and path"
    elif "connect" in text or "endpoint" in text:
        hint = "; check data.storage_options.endpoint_url and the network"
    return DataError(f"cannot read {what} {url}: {name}: {err}{hint}")


Locator = str | tuple[str, int, int]  # a path or URL, or a source's own: (a part's URL#name, byte offset, size)


FS_BYTES = "fsbytes:"  # prefix of a stored path whose file name is not valid UTF-8 (hex of the raw bytes)


def storable_path(path: str) -> str:
    """A path the store can hold (UTF-8): names with undecodable bytes are hex-encoded, reversibly."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return FS_BYTES + os.fsencode(path).hex()


def plain_utf8(text: str) -> bool:
    """Text that is UTF-8 as it is (no file name's undecodable byte, held as a surrogate): its own display name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def display_name(path: str) -> str:
    """A readable UTF-8 form of a file name (undecodable bytes shown as \\xNN)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def local_path(path: str) -> str | bytes:
    """The path to open for a stored local path (``fsbytes:`` names back to their bytes)."""
    if path.startswith(FS_BYTES):
        return bytes.fromhex(path[len(FS_BYTES):])
    return path.removeprefix("file://")


def read_file(item: str, storage_options: dict | None = None) -> bytes:
    """The bytes of a file: a local path (``fsbytes:`` names too) or an fsspec URL. A source's own locators (a tar
    member, a Parquet row) are read by :func:`~extractor.data.sources.read_bytes`."""
    return read_file_printed(item, storage_options)[0]


def read_file_printed(item: str, storage_options: dict | None = None) -> tuple[bytes, int]:
    """:func:`read_file`, with the :func:`local_fingerprint` of the file it opened, taken before its bytes are read
    (0: a URL). A fingerprint never newer than the bytes read: a file rewritten meanwhile differs from it later, and
    a resume compares its content."""
    if is_url(item):
        import fsspec

        with fsspec.open(item, "rb", **(storage_options or {})) as f:
            return f.read(), 0
    fd = os.open(local_path(item), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # (a FIFO's open waits for a writer)
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):  # (a FIFO, a device, a folder: no image, and a read may never end)
        os.close(fd)
        raise OSError(f"{item} is not a regular file")
    with open(fd, "rb") as f:
        return f.read(), stat_fingerprint(st)  # (stat-ed before the read)


def content_digest(data: bytes) -> int:
    """The content digest of an image's bytes as read: xxh3-64 (about 20 GB/s, well under 1% of a decode);
    never 0, which the store keeps for "not read"."""
    import xxhash

    return xxhash.xxh3_64_intdigest(data) or 1


def fingerprint(*facts: object) -> int:
    """A cheap fingerprint of where an image's bytes come from (a file's size, mtime, ctime and inode; an
    object's size and ETag; a part's fingerprint and a row's place in it): when it is unchanged, the bytes are
    taken to be. Never 0 (unknown)."""
    import xxhash

    return xxhash.xxh3_64_intdigest("|".join(map(str, facts)).encode("utf-8", "surrogateescape")) or 1


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def part_fingerprints(part_print: int, *places: Any) -> np.ndarray:
    """The fingerprint of each row of a part (a Parquet file, a tar) from the part's fingerprint and the row's
    place in it (``places``: arrays of integers, a row's row number; a member's offset and size), in bulk: each
    place folded in by splitmix64's finalizer, a bijection, so rows at one place differ where their parts' prints
    do. uint64, never 0; all 0 (unknown) where ``part_print`` is. (``fingerprint(part, row, 0)`` a row at a time
    before: 0.7 us of Python a row, most of a 100M-row Parquet listing.)"""
    n = len(places[0]) if places else 0
    if not part_print:
        return np.zeros(n, np.uint64)
    out = np.full(n, np.uint64(part_print % (1 << 64)), np.uint64)
    with np.errstate(over="ignore"):
        for place in places:
            out ^= np.asarray(place).astype(np.uint64) * _GOLDEN
            out ^= out >> np.uint64(30)
            out *= _MIX1
            out ^= out >> np.uint64(27)
            out *= _MIX2
            out ^= out >> np.uint64(31)
    out[out == 0] = 1
    return out


def local_fingerprint(path: str) -> int:
    """The fingerprint of a local file, or 0 when it cannot be seen (its row fails on read).

    Its size and mtime, and its ctime and inode: ``touch -r`` (``os.utime``) puts an mtime back, never a
    ctime, and a file replaced by another has another inode. Stores made before ctime and inode were part of
    it recorded ``fingerprint(size, mtime)``: every row of theirs differs now, so a resume reads their bytes
    once and compares content digests (the ground truth), then records the new fingerprints. A ctime moves
    also on chmod or a new hard link, and an inode on a copy: such rows cost a digest read, never a wrong
    answer.
    """
    try:
        return stat_fingerprint(os.stat(local_path(path)))
    except OSError:
        return 0


def stat_fingerprint(st: os.stat_result) -> int:
    """:func:`local_fingerprint` of a file stat-ed (by its name, or the file opened); 0 where it is not a regular
    file (a folder, a FIFO, a device: as a file that cannot be seen, its bytes not read)."""
    if not stat.S_ISREG(st.st_mode):
        return 0
    return fingerprint(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def remote_fingerprint(info: dict[str, Any]) -> int:
    """The fingerprint of an object from its fsspec ``info`` (size, and its ETag or modification time), 0 when
    the store says neither."""
    tag = next((info[k] for k in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated")
                if info.get(k) is not None), None)
    return 0 if tag is None else fingerprint(info.get("size"), tag)


_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}|\{([^{}]*,[^{}]*)\}")


def matched_urls(patterns: str | Sequence[str] | None, storage: dict[str, Any], setting: str) -> list[str]:
    """The files a setting (``data.parquet``, ``data.tars``) names, in order: brace patterns expanded, globs matched
    (sorted; an object store's through fsspec), other paths as they are (absolute)."""
    pats = [patterns] if isinstance(patterns, str) else list(patterns or [])
    urls: list[str] = []
    for pattern in (p for pat in pats for p in expand_braces(pat)):
        if not _a_glob(pattern):
            urls.append(absolute(pattern))
        elif is_url(pattern):
            import fsspec

            try:
                fs, path = fsspec.core.url_to_fs(pattern, **storage)
                protocol = pattern.split("://", 1)[0]
                urls += [p if "://" in p else f"{protocol}://{p}" for p in sorted(fs.glob(path))]
            except Exception as err:
                raise remote_error(setting, pattern, err) from err
        else:
            urls += [absolute(p) for p in sorted(glob.glob(pattern, recursive=True))]
    return urls


def _a_glob(pattern: str) -> bool:
    """Whether a path is matched as a glob: it holds ``*``, ``?`` or ``[``, is not an HTTP URL (a query string's
    ``?``: ``...tar?download=true``), and is not a local file that exists as named (``run[1]/shard.tar``, or a
    listing's recorded files named again)."""
    if not glob.has_magic(pattern) or pattern.lower().startswith(("http://", "https://")):
        return False
    return is_url(pattern) or not os.path.exists(pattern)


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
